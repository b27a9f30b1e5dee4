# syntax=docker/dockerfile:1
# Images for the chat system, one target each:
#   docker build --target cdc-relay    -t outbox/cdc-relay .
#   docker build --target chat-service -t outbox/chat-service .
#   docker build --target migrate      -t outbox/migrate .
# The build stage compiles everything once; the final images hold one binary (plus the
# healthcheck probe) on distroless/cc: glibc and CA roots, no shell, no package manager, no
# build tools, running as the unprivileged user 65532.
#
# Two build arguments for hosts without a registry (see docs/deployment.md, "Images"):
#   RUNTIME_BASE  the base of the final images; deploy/images/build-bases.sh makes one from
#                 Debian's packages (localhost/outbox/runtime:bookworm)
#   BINARIES      `prebuilt` takes the binaries from .prebuilt/ in the build context instead of
#                 compiling them (the container test puts the ones its build already made there)
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12:nonroot
ARG BINARIES=build

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --no-default-features -p cdc-relay -p chat-services \
 && mkdir -p /out \
 && cp target/release/cdc-relay target/release/chat-service target/release/migrate \
       target/release/healthcheck /out/

FROM scratch AS prebuilt
COPY .prebuilt/ /out/

FROM ${BINARIES} AS binaries

FROM ${RUNTIME_BASE} AS runtime
USER 65532:65532

FROM runtime AS cdc-relay
COPY --from=binaries /out/cdc-relay /out/healthcheck /usr/local/bin/
# Admin server: /healthz, /readyz, /metrics. Bound to all interfaces inside the container so
# probes and Prometheus reach it; publish it only to the cluster network.
ENV CDC_ADMIN_ADDR=0.0.0.0:9187 LOG_FORMAT=json
EXPOSE 9187
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s \
  CMD ["/usr/local/bin/healthcheck", "http://127.0.0.1:9187/healthz"]
ENTRYPOINT ["/usr/local/bin/cdc-relay"]
CMD ["run"]

FROM runtime AS chat-service
COPY --from=binaries /out/chat-service /out/healthcheck /usr/local/bin/
# Admin listener: /healthz, /readyz, /metrics, kept off the public port.
ENV LISTEN_ADDR=0.0.0.0:8080 CHAT_ADMIN_ADDR=0.0.0.0:9090 LOG_FORMAT=json
EXPOSE 8080 9090
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s \
  CMD ["/usr/local/bin/healthcheck", "http://127.0.0.1:9090/readyz"]
ENTRYPOINT ["/usr/local/bin/chat-service"]

FROM runtime AS migrate
COPY --from=binaries /out/migrate /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/migrate"]
