# The CPU stack's Redis where redis:7.4-alpine cannot be pulled (compose.ci.yml): Debian's
# redis-server on the same base as eyrie-base. Also runs the preflight script (it needs a sh).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
