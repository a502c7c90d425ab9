#!/usr/bin/env bash
# The base image eyrie-base builds FROM: the official python:3.11-slim-bookworm when it can be
# pulled (or is already here), otherwise a local one of the same Debian and Python, made with
# debootstrap and `docker import`. Prints the image to use.
set -euo pipefail
OFFICIAL=python:3.11-slim-bookworm
LOCAL=eyrie-local/bookworm-python:3.11
for image in "$OFFICIAL" "$LOCAL"; do
  docker image inspect "$image" >/dev/null 2>&1 && { echo "$image"; exit 0; }
done
timeout 60 docker pull -q "$OFFICIAL" >/dev/null 2>&1 && { echo "$OFFICIAL"; exit 0; }
echo "base-image: $OFFICIAL cannot be pulled; making $LOCAL with debootstrap" >&2
command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
root=$(mktemp -d)
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,tini \
  bookworm "$root" http://deb.debian.org/debian >/dev/null
# `python` as in the official image (healthchecks call it); apt lists and caches out of the layer
ln -sf python3 "$root/usr/bin/python"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$LOCAL" >/dev/null
rm -rf "$root"
echo "$LOCAL"
