//! The upstream leg: a pooled hyper client over rustls (webpki roots) or plain HTTP for local
//! upstreams, header forwarding as a proxy must (RFC 9110 §7.6.1 hop-by-hop fields), and the
//! configured timeouts.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::config::Config;
use crate::error::WireError;
use crate::metrics::{ApiLabels, ReasonLabels};
use crate::server::AppState;

/// The upstream HTTP client type.
pub type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Builds the pooled client: HTTP/1.1 and HTTP/2 over rustls with the webpki roots, plain
/// HTTP allowed for local upstreams (vLLM, Ollama, mocks).
pub fn client(config: &Config) -> HttpClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(Duration::from_millis(
        config.upstream_connect_timeout_ms,
    )));
    http.set_nodelay(true);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(https)
}

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
/// `content-length` removed when the body may change.
pub fn response_headers(upstream: &HeaderMap, keep_length: bool) -> HeaderMap {
    let listed = connection_listed(upstream);
    let mut out = HeaderMap::with_capacity(upstream.len());
    for (name, value) in upstream {
        let n = name.as_str();
        if is_hop_by_hop(name)
            || listed.iter().any(|l| l == n)
            || (!keep_length && n == "content-length")
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// Sends one request to the upstream named `upstream` and waits for its response headers.
///
/// Errors: [`WireError::UpstreamNotConfigured`], or [`WireError::UpstreamUnavailable`] when
/// the connection fails or the headers do not arrive within `upstream_response_timeout_ms`.
pub async fn send(
    state: &AppState,
    upstream: &str,
    api_label: &str,
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
    api_label: &str,
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
    let unavailable = |reason: &str, detail: String| {
        state
            .metrics
            .upstream_errors
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
        WireError::UpstreamUnavailable {
            upstream: upstream.to_owned(),
            reason: detail,
        }
    };
    let result = tokio::time::timeout(timeout, state.client.request(req)).await;
    crate::edge::upstream_waited(started, started.elapsed());
    let resp = match result {
        Err(_) => {
            return Err(unavailable(
                "response_timeout",
                format!("no response headers within {} ms", timeout.as_millis()),
            ))
        }
        Ok(Err(e)) => {
            let detail = if e.is_connect() {
                "connection failed".to_owned()
            } else {
                "request failed".to_owned()
            };
            return Err(unavailable("connect", detail));
        }
        Ok(Ok(r)) => r,
    };
    state
        .metrics
        .upstream_latency
        .get_or_create(&ApiLabels {
            api: api_label.to_owned(),
        })
        .observe(started.elapsed().as_secs_f64());
    Ok(resp)
}
