"""Training data without ComfyUI: dataset folders of images (``files.py``, ``image_reading.py``) and of video
clips (``video_files.py``, with the frame counts video VAEs encode: ``frames.py``), and the on-disk encode
cache's entries (``encode_cache.py``). Pure: imports torch, PIL and the pack's ``training`` helpers only."""
