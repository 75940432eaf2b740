"""mmcache: a shared, durable, replayable encoder-cache affinity index.

The packages, lowest first (each imports only those before it): ``core`` (pure: items,
events, the fold, matching), ``kafka`` (the event log), ``state`` (files on disk),
``http`` (the API), ``worker`` (the Faust worker that wires them), then ``sim``,
``gateway`` (the reference gateway) and ``bench`` on top; ``cli`` parses the command line
and calls them. Loose modules are shared by all: ``config``, ``metrics``, ``logs``,
``event_loop``, ``compiled``, ``internals``.
"""

__version__ = "0.1.0"
