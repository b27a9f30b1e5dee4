# syntax=docker/dockerfile:1
# Images for the chat system, one target each:
#   docker build --target cdc-relay    -t outbox/cdc-relay .
#   docker build --target chat-service -t outbox/chat-service .
#   docker build --target migrate      -t outbox/migrate .
# The build stage compiles everything once; the final images hold one binary (plus the
# healthcheck probe) on distroless/cc: glibc and CA roots, no shell, no package manager, no
# build tools, running as the unprivileged `nonroot` user (uid 65532).

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --no-default-features -p cdc-relay -p chat-services \
 && mkdir -p /out \
 && cp target/release/cdc-relay target/release/chat-service target/release/migrate \
       target/release/healthcheck /out/

FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
USER nonroot:nonroot

FROM runtime AS cdc-relay
COPY --from=build /out/cdc-relay /out/healthcheck /usr/local/bin/
# Admin server: /healthz, /readyz, /metrics. Bound to all interfaces inside the container so
# probes and Prometheus reach it; publish it only to the cluster network.
ENV CDC_ADMIN_ADDR=0.0.0.0:9187 LOG_FORMAT=json
EXPOSE 9187
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s \
  CMD ["/usr/local/bin/healthcheck", "http://127.0.0.1:9187/healthz"]
ENTRYPOINT ["/usr/local/bin/cdc-relay"]
CMD ["run"]

FROM runtime AS chat-service
COPY --from=build /out/chat-service /out/healthcheck /usr/local/bin/
# Admin listener: /healthz, /readyz, /metrics, kept off the public port.
ENV LISTEN_ADDR=0.0.0.0:8080 CHAT_ADMIN_ADDR=0.0.0.0:9090 LOG_FORMAT=json
EXPOSE 8080 9090
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s \
  CMD ["/usr/local/bin/healthcheck", "http://127.0.0.1:9090/readyz"]
ENTRYPOINT ["/usr/local/bin/chat-service"]

FROM runtime AS migrate
COPY --from=build /out/migrate /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/migrate"]
