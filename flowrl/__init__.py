"""flowrl: reinforcement-learning dataflow for language models, placed and re-placed on Dask."""
