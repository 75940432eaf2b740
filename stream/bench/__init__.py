"""`mmcache bench`: figures that matter, each beside a control measured in the same run."""
