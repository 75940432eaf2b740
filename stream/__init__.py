"""mmcache: a shared, durable, replayable encoder-cache affinity index."""

__version__ = "0.1.0"
