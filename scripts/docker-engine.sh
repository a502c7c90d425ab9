#!/usr/bin/env bash
# A Docker engine, Compose v2 and buildx on this machine, when none answers (idempotent, fast when
# present). Engine: Debian's docker.io, its own data root under /var/lib (images stay cached between
# runs). Compose v2 and buildx: Debian 13's packages (Go binaries), unpacked into ~/.docker/cli-plugins.
set -euo pipefail
DATA_ROOT=${EYRIE_DOCKER_DATA_ROOT:-/var/lib/eyrie-docker}
PLUGINS=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins
log() { echo "docker-engine: $*" >&2; }

apt_quiet() { DEBIAN_FRONTEND=noninteractive apt-get "$@" -qq >/dev/null; }

engine() {
  docker info >/dev/null 2>&1 && return
  command -v dockerd >/dev/null || { log "installing docker.io"; apt_quiet update; apt_quiet install -y docker.io; }
  log "starting dockerd (data root $DATA_ROOT)"
  mkdir -p "$DATA_ROOT" /var/log
  nohup dockerd --data-root "$DATA_ROOT" --exec-root /var/run/eyrie-docker \
        -H unix:///var/run/docker.sock >/var/log/eyrie-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
  log "dockerd did not answer; see /var/log/eyrie-dockerd.log"; tail -20 /var/log/eyrie-dockerd.log >&2; exit 1
}

# one plugin from a Debian 13 package: $1 package, $2 plugin name
trixie_plugin() {
  local pkg=$1 name=$2 tmp
  docker "${name#docker-}" version >/dev/null 2>&1 && return
  log "fetching $pkg from Debian 13"
  tmp=$(mktemp -d)
  echo "deb http://deb.debian.org/debian trixie main" > "$tmp/trixie.list"
  local opts=(-o "Dir::Etc::SourceList=$tmp/trixie.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root)
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
  apt-get "${opts[@]}" update -qq >/dev/null
  (cd "$tmp" && apt-get "${opts[@]}" download -qq "$pkg" >/dev/null)
  dpkg -x "$tmp"/"$pkg"_*.deb "$tmp/root"
  mkdir -p "$PLUGINS"
  install -m 0755 "$(find "$tmp/root" -path "*/cli-plugins/$name" -type f | head -1)" "$PLUGINS/$name"
  rm -rf "$tmp"
}

engine
trixie_plugin docker-compose docker-compose
trixie_plugin docker-buildx docker-buildx
docker compose version >&2
docker buildx version >&2
