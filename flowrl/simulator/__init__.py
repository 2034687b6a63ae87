"""A simulated cluster for comparing scheduler policies at scale on a laptop."""
