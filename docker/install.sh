#!/bin/sh
# The image's install step, also run by tests/test_deploy.py in a fresh virtual environment so
# the Dockerfile cannot rot unnoticed. Usage: docker/install.sh VENV_DIR [SOURCE_DIR]
set -eu
venv="$1"
src="${2:-.}"
python3 -m venv "$venv"
"$venv/bin/pip" install --no-cache-dir --disable-pip-version-check -r "$src/requirements.lock"
"$venv/bin/pip" install --no-cache-dir --disable-pip-version-check --no-deps "$src"
# Refuse to ship without aiohttp's C parser (its pure-Python fallback has had smuggling advisories).
"$venv/bin/python" -c "from sidecar.app import c_parser_in_use; assert c_parser_in_use(), 'aiohttp C parser missing'"
