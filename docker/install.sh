#!/bin/sh
# The image's install step, also run by tests/integration/test_deploy.py in a fresh virtual environment so
# the Dockerfile cannot rot unnoticed. Usage: docker/install.sh VENV_DIR [SOURCE_DIR]
# The hot path is compiled with mypyc (setup.py); RETRY_SIDECAR_BUILD=pure installs the pure
# Python build instead. mypy is needed only to build and is removed afterwards.
set -eu
venv="$1"
src="${2:-.}"
build="${RETRY_SIDECAR_BUILD:-compiled}"
# pip's cache stays on: in the image it lives in the build stage, which the runtime stage does not
# copy; in the test suite it holds the wheels the test extra's install just fetched.
pip="$venv/bin/pip --disable-pip-version-check"
python3 -m venv "$venv"
# The OTLP exporters too: a collector named by OTEL_EXPORTER_OTLP_ENDPOINT gets traces from the
# image as it is, in either protocol.
$pip install -r "$src/requirements.lock" -r "$src/requirements-otlp.lock"
if [ "$build" = compiled ]; then
  $pip install "setuptools>=68" wheel "mypy==2.4.1"
  RETRY_SIDECAR_BUILD=compiled $pip install --no-build-isolation --no-deps "$src"
  $pip uninstall -y mypy ast-serialize librt pathspec
else
  RETRY_SIDECAR_BUILD=pure $pip install --no-deps "$src"
fi
# Refuse to ship without aiohttp's C parser (its pure-Python fallback has had smuggling advisories).
"$venv/bin/python" -c "from sidecar.proxy.runner import c_parser_in_use; assert c_parser_in_use(), 'aiohttp C parser missing'"
"$venv/bin/retry-sidecar" --version
