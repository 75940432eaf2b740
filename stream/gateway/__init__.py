"""A reference gateway in front of vLLM servers: the picker rules of docs/gateway.md on
mmcache's answers, small enough to read, used to measure a real fleet."""
