# syntax=docker/dockerfile:1
# retry-sidecar: multi-stage build; the runtime stage has no compilers and runs as a numeric
# non-root user on a read-only root filesystem (only /data, the DLQ directory, is written).

# The build stage has a C compiler (the full image): the hot path is compiled with mypyc.
FROM python:3.11-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md requirements.lock requirements-otlp.lock ./
COPY docker/install.sh docker/install.sh
COPY sidecar ./sidecar
# The same script the test suite runs in a fresh virtual environment.
RUN sh docker/install.sh /opt/venv /src

FROM python:3.11-slim-bookworm AS runtime
# tini reaps children and forwards SIGTERM to the sidecar as PID 1 would not by default.
# DL3008: tini is pinned by the Debian release of the base image (bookworm), not by version.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data /etc/retry-sidecar \
    && chown 10001:10001 /data
COPY --from=build /opt/venv /opt/venv
COPY docker/sidecar.yaml /etc/retry-sidecar/sidecar.yaml
ENV PATH="/opt/venv/bin:${PATH}" \
    RETRY_SIDECAR_CONFIG=/etc/retry-sidecar/sidecar.yaml \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
VOLUME ["/data"]
EXPOSE 15001 15000
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["retry-sidecar", "healthcheck"]
ENTRYPOINT ["/usr/bin/tini", "--", "retry-sidecar"]
CMD ["run"]
