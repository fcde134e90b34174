"""Datasets: Precision Load Image Dataset (folder reading and its report), the cached training dataset and
Resolution Buckets."""
