"""The state on disk: how entries are laid out in RocksDB (``store``), what a data dir
records and when it may be reused (``datadir``), how saved partitions enter the view
(``view_load``, ``preload``), and the offline ``rebuild`` from the log."""
