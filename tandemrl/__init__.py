"""TandemRL: asynchronous RL post-training with two pumps under one controller."""

__version__ = "0.1.0"
