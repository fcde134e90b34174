"""The diffusion model: what it is (family, heads, default softmax scale), loading a file into weights training
can use (Precision Load Diffusion Model), and LATENT / CONDITIONING inputs checked against it."""
