# Shared by the bench scripts (sourced, not run): a free loopback port, and the bench's policy
# bundle — the acme example with its per-(principal, tool) rate bucket raised so the bench's
# single agent is never rate-limited.

free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

# bench_bundle DIR: copies policy/examples/acme to DIR/policy with the bucket raised.
bench_bundle() {
  cp -r policy/examples/acme "$1/policy"
  sed -i -e 's/^burst = .*/burst = 100000000/' -e 's/^per_minute = .*/per_minute = 100000000/' \
    "$1/policy/turnguard.toml"
}

# bench_tool: prints the benchtool to run: $BENCHTOOL when set (an earlier build; the scripts
# use only its mock and load generator, so any build serves and nothing is compiled while
# measuring), else this checkout's release build, built first.
bench_tool() {
  if [ -n "${BENCHTOOL:-}" ]; then
    realpath "$BENCHTOOL"
  else
    cargo build --release --locked --example benchtool 2>&1 | tail -1 >&2
    echo "$CARGO_TARGET_DIR/release/examples/benchtool"
  fi
}

# allocator_features NAME: the cargo flags of a turnguard build with global allocator NAME
# (`jemalloc`, the default build; `mimalloc`; `system`, the C library's malloc).
allocator_features() {
  case "$1" in
    jemalloc) ;;
    mimalloc) echo --features mimalloc ;;
    system) echo --no-default-features ;;
    *) echo "unknown allocator $1 (jemalloc, mimalloc or system)" >&2; return 1 ;;
  esac
}
