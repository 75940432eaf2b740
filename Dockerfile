FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY stream ./stream
RUN pip install --no-cache-dir .
ENV MMCACHE_HOST=0.0.0.0 MMCACHE_DATA_DIR=/data
VOLUME /data
EXPOSE 8080
ENTRYPOINT ["mmcache"]
CMD ["serve"]
