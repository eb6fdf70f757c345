#!/usr/bin/env bash
# Prints pyproject.toml's [build-system] requirements but torch, one a line: what every environment that
# builds the kernels installs (with its own torch), so that each builds with the same minimums, whatever
# Python made it (a new venv of Python 3.11 keeps the setuptools 65.5 it ships, too old for pyproject's
# licence string: `pip install setuptools` leaves it, `pip install "setuptools>=77"` upgrades it).
set -euo pipefail
cd "$(dirname "$0")/.."
awk '/^\[/ { section = $0 } section == "[build-system]" && /^requires *=/ { grab = 1 } grab { print; if (/\]/) grab = 0 }' \
  pyproject.toml | grep -o '"[^"]*"' | tr -d '"' | grep -Ev '^torch([<>=!~ ;]|$)'
