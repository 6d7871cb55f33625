//! The upstream leg: a pooled hyper client over rustls (webpki roots) or plain HTTP for local
//! upstreams, header forwarding as a proxy must (RFC 9110 §7.6.1 hop-by-hop fields), and the
//! configured timeouts.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::error::WireError;
use crate::metrics::{ApiLabels, ReasonLabels, UpstreamError};
use crate::state::AppState;

pub use crate::client::{client, HttpClient};

/// Hop-by-hop fields (RFC 9110 §7.6.1) plus fields the proxy sets itself.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Names listed in the `Connection` field are hop-by-hop too.
fn connection_listed(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The agent's headers as sent upstream: hop-by-hop, `host`, `content-length` and
/// turnguard's own `turnguard-*` fields removed; auth headers (`authorization`, `x-api-key`,
/// `anthropic-version`, `anthropic-beta`, `openai-organization` …) passed unchanged. When
/// turnguard parses the response, `accept-encoding` is set to `identity`.
pub fn request_headers(incoming: &HeaderMap, parse_response: bool) -> HeaderMap {
    let listed = connection_listed(incoming);
    let mut out = HeaderMap::with_capacity(incoming.len());
    for (name, value) in incoming {
        let n = name.as_str();
        if is_hop_by_hop(name)
            || n == "host"
            || n == "content-length"
            || n.starts_with("turnguard-")
            || listed.iter().any(|l| l == n)
            || (parse_response && n == "accept-encoding")
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if parse_response {
        out.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
    out
}

/// The upstream's response headers as sent to the agent: hop-by-hop fields removed, and
/// `content-length` and `content-encoding` removed when the body may change (turnguard parsed
/// it, decoded when it was coded: the agent gets identity bytes).
pub fn response_headers(upstream: &HeaderMap, keep_length: bool) -> HeaderMap {
    let listed = connection_listed(upstream);
    let mut out = HeaderMap::with_capacity(upstream.len());
    for (name, value) in upstream {
        let n = name.as_str();
        if is_hop_by_hop(name)
            || listed.iter().any(|l| l == n)
            || (!keep_length && (n == "content-length" || n == "content-encoding"))
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// A status that is neither an answer nor an error (1xx: `101` included; 3xx: a redirect,
/// `304`): turnguard never relays one ([`relayed`], the MCP front), so a `Location` cannot
/// send a client that follows redirects around it.
pub fn neither_answer_nor_error(status: http::StatusCode) -> bool {
    status.is_informational() || status.is_redirection()
}

/// The 502 for `upstream` (`detail` says why), counted in `turnguard_upstream_errors_total`
/// under `reason`.
fn counted(state: &AppState, upstream: &str, reason: UpstreamError, detail: String) -> WireError {
    state
        .metrics
        .upstream_errors
        .get_or_create(&ReasonLabels { reason })
        .inc();
    WireError::UpstreamUnavailable {
        upstream: upstream.to_owned(),
        reason: detail,
    }
}

/// An upstream answer turnguard relays without parsing it (a provider's error answer, a
/// passthrough route's answer), as the agent gets it: the whole body read first, within the
/// bounds a model answer has (`upstream_idle_timeout_ms` between chunks, everything by
/// `deadline`, at most `max_response_bytes`), then sent with the upstream's status and headers
/// (hop-by-hop fields removed, the length the body's own).
///
/// Errors ([`WireError::UpstreamUnavailable`], the provider-shaped 502, counted in
/// `turnguard_upstream_errors_total`):
/// - an informational or redirect status (1xx, 3xx: `101`, `304`, a `307` whose `Location`
///   the official SDKs would follow to a host turnguard never sees);
/// - a body that stalls, drips past the deadline, fails, or outgrows the cap. Relayed as it
///   came, such a body held the agent (and its concurrency permit) for as long as the
///   upstream liked.
pub async fn relayed(
    state: &AppState,
    upstream: &str,
    resp: Response<Incoming>,
    deadline: tokio::time::Instant,
) -> Result<Response<axum::body::Body>, WireError> {
    let status = resp.status();
    let unavailable =
        |reason: UpstreamError, detail: String| counted(state, upstream, reason, detail);
    if neither_answer_nor_error(status) {
        return Err(unavailable(
            UpstreamError::UnexpectedStatus,
            format!(
                "the upstream answered HTTP {}, which is neither an answer nor an error; turnguard relays no informational or redirect answer",
                status.as_u16()
            ),
        ));
    }
    let idle = Duration::from_millis(state.config.upstream_idle_timeout_ms);
    let cap = state.config.max_response_bytes;
    let within = deadline.saturating_duration_since(tokio::time::Instant::now());
    let (parts, body) = resp.into_parts();
    let bytes = crate::body::read_capped_within(body, cap, Some(idle), within)
        .await
        .map_err(|e| {
            let reason = match &e {
                crate::body::BodyError::TimedOut(crate::body::TimedOut::Idle(_)) => {
                    UpstreamError::IdleTimeout
                }
                crate::body::BodyError::TimedOut(crate::body::TimedOut::Deadline(_)) => {
                    UpstreamError::ResponseTimeout
                }
                _ => UpstreamError::Connect,
            };
            unavailable(
                reason,
                format!("the upstream's answer was not relayed: {e} (upstream_idle_timeout_ms, upstream_response_timeout_ms, max_response_bytes)"),
            )
        })?;
    let mut out = Response::new(axum::body::Body::from(bytes));
    *out.status_mut() = parts.status;
    *out.headers_mut() = response_headers(&parts.headers, true);
    out.headers_mut().remove(header::CONTENT_LENGTH);
    Ok(out)
}

/// Sends one request to the upstream named `upstream` and waits for its response headers.
///
/// Errors: [`WireError::UpstreamNotConfigured`], or [`WireError::UpstreamUnavailable`] when
/// the connection fails or the headers do not arrive within `upstream_response_timeout_ms`.
pub async fn send(
    state: &AppState,
    upstream: &str,
    api_label: crate::metrics::ApiLabel,
    method: Method,
    path_and_query: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response<Incoming>, WireError> {
    let target =
        state
            .config
            .upstreams
            .get(upstream)
            .ok_or_else(|| WireError::UpstreamNotConfigured {
                upstream: upstream.to_owned(),
            })?;
    send_to(
        state,
        target,
        upstream,
        api_label,
        method,
        path_and_query,
        headers,
        body,
    )
    .await
}

/// [`send`] to a configured target (`upstream` names it in errors and metrics): an API
/// upstream, or an MCP server of the MCP front ([`crate::mcp`]).
#[allow(clippy::too_many_arguments)]
pub async fn send_to(
    state: &AppState,
    target: &crate::config::Upstream,
    upstream: &str,
    api_label: crate::metrics::ApiLabel,
    method: Method,
    path_and_query: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response<Incoming>, WireError> {
    let uri = target
        .uri(path_and_query)
        .map_err(|e| WireError::Internal {
            reason: format!("cannot build the upstream URI: {e}"),
        })?;
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .body(Full::new(body))
        .map_err(|e| WireError::Internal {
            reason: format!("cannot build the upstream request: {e}"),
        })?;
    *req.headers_mut() = headers;
    let started = Instant::now();
    let timeout = Duration::from_millis(state.config.upstream_response_timeout_ms);
    let unavailable =
        |reason: UpstreamError, detail: String| counted(state, upstream, reason, detail);
    // The deadline and the wait are both taken from `started`: one clock read before the
    // request and one after it.
    let deadline = tokio::time::Instant::from_std(started) + timeout;
    let result = tokio::time::timeout_at(deadline, state.client.request(req)).await;
    let waited = started.elapsed();
    crate::edge::upstream_waited(started, waited);
    let resp = match result {
        Err(_) => {
            return Err(unavailable(
                UpstreamError::ResponseTimeout,
                format!("no response headers within {} ms", timeout.as_millis()),
            ))
        }
        Ok(Err(e)) => {
            let detail = if e.is_connect() {
                "connection failed".to_owned()
            } else {
                "request failed".to_owned()
            };
            return Err(unavailable(UpstreamError::Connect, detail));
        }
        Ok(Ok(r)) => r,
    };
    state
        .metrics
        .upstream_latency
        .get_or_create(&ApiLabels { api: api_label })
        .observe(waited.as_secs_f64());
    Ok(resp)
}

/// The `Content-Encoding` of an upstream body turnguard parses. turnguard asks for
/// `identity`, but an upstream (or a box in front of it) may compress anyway; a body is
/// classified only after it is decoded, and the size caps apply to the decoded bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentCoding {
    /// No coding (absent or `identity`).
    Identity,
    /// `gzip` / `x-gzip` (RFC 9110 §8.4.1.3; multi-member streams included).
    Gzip,
    /// `deflate`: the zlib format (RFC 9110 §8.4.1.2).
    Deflate,
}

/// Reads the `Content-Encoding` of a response turnguard will parse.
///
/// Errors: any other coding (`br`, `zstd`, a stack of codings …): turnguard cannot read the
/// body, so it refuses it (502) rather than relay bytes it did not classify.
pub fn content_coding(headers: &HeaderMap) -> Result<ContentCoding, String> {
    let mut codings = Vec::new();
    for v in headers.get_all(header::CONTENT_ENCODING) {
        let v = v
            .to_str()
            .map_err(|_| "a Content-Encoding that is not ASCII".to_owned())?;
        codings.extend(
            v.split(',')
                .map(|c| c.trim().to_ascii_lowercase())
                .filter(|c| !c.is_empty() && c != "identity"),
        );
    }
    match codings.as_slice() {
        [] => Ok(ContentCoding::Identity),
        [one] if one == "gzip" || one == "x-gzip" => Ok(ContentCoding::Gzip),
        [one] if one == "deflate" => Ok(ContentCoding::Deflate),
        other => Err(format!(
            "the upstream answered with Content-Encoding `{}`, which turnguard cannot decode (it asks for identity; gzip and deflate are decoded)",
            other
                .join(", ")
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | ',' | ' ' | '_'))
                .take(80)
                .collect::<String>()
        )),
    }
}

/// Compressed bytes fed to the decoder at a time: at most ~1032× this comes out of one step
/// (deflate's largest ratio), so a compression bomb never expands unchecked.
const DECODE_STEP: usize = 1024;

/// An incremental decoder for one body (flate2).
pub struct Decoder {
    inner: DecoderInner,
}

enum DecoderInner {
    Identity,
    Gzip(Box<flate2::write::MultiGzDecoder<Vec<u8>>>),
    Deflate(Box<flate2::write::ZlibDecoder<Vec<u8>>>),
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            DecoderInner::Identity => "identity",
            DecoderInner::Gzip(_) => "gzip",
            DecoderInner::Deflate(_) => "deflate",
        };
        f.debug_struct("Decoder").field("coding", &kind).finish()
    }
}

impl Decoder {
    /// A decoder for `coding`.
    pub fn new(coding: ContentCoding) -> Self {
        let inner = match coding {
            ContentCoding::Identity => DecoderInner::Identity,
            ContentCoding::Gzip => {
                DecoderInner::Gzip(Box::new(flate2::write::MultiGzDecoder::new(Vec::new())))
            }
            ContentCoding::Deflate => {
                DecoderInner::Deflate(Box::new(flate2::write::ZlibDecoder::new(Vec::new())))
            }
        };
        Self { inner }
    }

    /// Decodes `data`, handing the decoded bytes to `sink` in pieces (each from at most
    /// [`DECODE_STEP`] compressed bytes), so the caller bounds what it keeps.
    ///
    /// Errors: the bytes are not valid for the coding, or `sink` refused a piece.
    pub fn push(
        &mut self,
        data: &[u8],
        sink: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        use std::io::Write;
        match &mut self.inner {
            DecoderInner::Identity => sink(data),
            DecoderInner::Gzip(d) => {
                for piece in data.chunks(DECODE_STEP) {
                    d.write_all(piece)
                        .map_err(|e| format!("the gzip body does not decode: {e}"))?;
                    let out = std::mem::take(d.get_mut());
                    if !out.is_empty() {
                        sink(&out)?;
                    }
                }
                Ok(())
            }
            DecoderInner::Deflate(d) => {
                for piece in data.chunks(DECODE_STEP) {
                    d.write_all(piece)
                        .map_err(|e| format!("the deflate body does not decode: {e}"))?;
                    let out = std::mem::take(d.get_mut());
                    if !out.is_empty() {
                        sink(&out)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// The end of the body: the decoded bytes still buffered.
    ///
    /// Errors: the coded stream is not complete.
    pub fn finish(
        &mut self,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        match &mut self.inner {
            DecoderInner::Identity => Ok(()),
            DecoderInner::Gzip(d) => {
                d.try_finish()
                    .map_err(|e| format!("the gzip body ends early: {e}"))?;
                let out = std::mem::take(d.get_mut());
                if out.is_empty() {
                    Ok(())
                } else {
                    sink(&out)
                }
            }
            DecoderInner::Deflate(d) => {
                d.try_finish()
                    .map_err(|e| format!("the deflate body ends early: {e}"))?;
                let out = std::mem::take(d.get_mut());
                if out.is_empty() {
                    Ok(())
                } else {
                    sink(&out)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(bytes).unwrap();
        enc.finish().unwrap()
    }

    #[test]
    fn coded_bodies_decode_in_pieces_and_whole() {
        let text: Vec<u8> = (0..50_000u32)
            .flat_map(|i| format!("data: {i}\n\n").into_bytes())
            .collect();
        for (coding, coded) in [
            (ContentCoding::Gzip, gzip(&text)),
            (ContentCoding::Deflate, {
                let mut enc =
                    flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
                enc.write_all(&text).unwrap();
                enc.finish().unwrap()
            }),
        ] {
            let mut whole = Decoder::new(coding);
            let mut out = Vec::new();
            let mut sink = |p: &[u8]| {
                out.extend_from_slice(p);
                Ok(())
            };
            whole.push(&coded, &mut sink).unwrap();
            whole.finish(&mut sink).unwrap();
            assert_eq!(out, text);
            let mut d = Decoder::new(coding);
            let mut out = Vec::new();
            for piece in coded.chunks(7) {
                d.push(piece, &mut |p| {
                    out.extend_from_slice(p);
                    Ok(())
                })
                .unwrap();
            }
            d.finish(&mut |p| {
                out.extend_from_slice(p);
                Ok(())
            })
            .unwrap();
            assert_eq!(out, text);
        }
    }

    #[test]
    fn only_identity_gzip_and_deflate_are_read() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::CONTENT_ENCODING, HeaderValue::from_str(v).unwrap());
            content_coding(&m)
        };
        assert_eq!(
            content_coding(&HeaderMap::new()),
            Ok(ContentCoding::Identity)
        );
        assert_eq!(h("identity"), Ok(ContentCoding::Identity));
        assert_eq!(h("GZIP"), Ok(ContentCoding::Gzip));
        assert_eq!(h("deflate"), Ok(ContentCoding::Deflate));
        for bad in ["br", "zstd", "gzip, gzip", "compress"] {
            assert!(h(bad).is_err(), "{bad}");
        }
    }
}
