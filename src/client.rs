//! The pooled outbound HTTP client every turnguard leg uses (upstream providers, MCP
//! servers, the approval webhook, the `approvals` CLI): hyper over rustls with the webpki
//! roots, plain HTTP allowed for local targets. Imports only the configuration.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::config::Config;

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
