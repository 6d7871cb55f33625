//! Misbehaving upstreams for the fault-injection suite (`tests/it/faults.rs`): raw tokio TCP
//! servers on `127.0.0.1:0` that read one HTTP/1.1 request per connection and then answer
//! badly on purpose — stall after the headers, trickle a body, or reset the connection in the
//! middle of a stream. They are deliberately not the scripted mock (`src/mock_provider.rs`),
//! which always speaks correct HTTP.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods
)] // test code

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// How the upstream answers every request.
#[derive(Debug, Clone)]
pub enum Fault {
    /// `200` with `content-type` and a `content-length` of `declared` bytes, then `sent` of
    /// them, then nothing at all (the connection stays open).
    StallAfterHeaders {
        content_type: &'static str,
        declared: usize,
        sent: Vec<u8>,
    },
    /// `200 application/json` with `content-length`, then `body` one byte every `every`: the
    /// upstream is never idle for long, but never done.
    Trickle { body: Vec<u8>, every: Duration },
    /// `200 text/event-stream` (chunked), `events` (each a whole SSE block), then a TCP reset
    /// (`SO_LINGER 0`), with no terminal event and no last chunk.
    ResetMidStream { events: Vec<String> },
}

/// A running faulty upstream.
pub struct Faulty {
    pub addr: SocketAddr,
    requests: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Faulty {
    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests read so far.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for Faulty {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts a faulty upstream answering every request with `fault`.
pub async fn spawn(fault: Fault) -> Faulty {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&requests);
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let fault = fault.clone();
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let _ = serve(tcp, fault, counter).await;
            });
        }
    });
    Faulty {
        addr,
        requests,
        task,
    }
}

/// Reads one request: headers up to the blank line, then `content-length` bytes of body.
pub async fn read_request(tcp: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = tcp.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = tcp.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(buf)
}

async fn serve(mut tcp: TcpStream, fault: Fault, counter: Arc<AtomicUsize>) -> std::io::Result<()> {
    read_request(&mut tcp).await?;
    counter.fetch_add(1, Ordering::SeqCst);
    match fault {
        Fault::StallAfterHeaders {
            content_type,
            declared,
            sent,
        } => {
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {declared}\r\n\r\n"
            );
            tcp.write_all(head.as_bytes()).await?;
            tcp.write_all(&sent).await?;
            tcp.flush().await?;
            // Stall: keep the connection open, send nothing more.
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        Fault::Trickle { body, every } => {
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            tcp.write_all(head.as_bytes()).await?;
            for b in body {
                tcp.write_all(&[b]).await?;
                tcp.flush().await?;
                tokio::time::sleep(every).await;
            }
        }
        Fault::ResetMidStream { events } => {
            tcp.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
            )
            .await?;
            for e in events {
                let block = format!("{e}\n\n");
                tcp.write_all(format!("{:x}\r\n{block}\r\n", block.len()).as_bytes())
                    .await?;
                tcp.flush().await?;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // A reset, not a clean close: SO_LINGER 0 makes the close send RST.
            #[allow(deprecated)]
            tcp.set_linger(Some(Duration::ZERO))?;
            drop(tcp);
        }
    }
    Ok(())
}
