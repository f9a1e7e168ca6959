//! Serving a [`SideEffectService`] over real HTTP/1.1, for tests that go through a real
//! client, connection pool and socket.

use std::fmt;
use std::io;
use std::net::SocketAddr;

use http::Uri;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};
use tower_service::Service;

use super::SideEffectService;

impl SideEffectService {
    /// Serve this provider over HTTP/1.1 on `listener`, one task per connection, until the
    /// returned [`ServeHandle`] is shut down or dropped.
    ///
    /// Calls are answered exactly as in-process (same counts, same fault queue, shared with
    /// every clone), except for how faults look on the wire:
    ///
    /// - [`Fault::RefuseBeforeSend`](super::Fault::RefuseBeforeSend) closes the connection
    ///   without reading the request body or answering. A client sees a failure *after* its
    ///   request was written (hyper-util reports an incomplete message), so a careful client
    ///   must treat it as in doubt. A true pre-write refusal over HTTP is a closed port:
    ///   shut the handle down, or point the client at an address nobody listens on.
    /// - [`Fault::CommitThenTimeout`](super::Fault::CommitThenTimeout) holds the response
    ///   open until the client gives up (or the handle is shut down).
    /// - [`Fault::Panic`](super::Fault::Panic) drops the connection.
    ///
    /// Call it inside a tokio runtime (it spawns the server task).
    ///
    /// # Errors
    ///
    /// When the listener's local address cannot be read.
    ///
    /// # Example
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http_body_util::Full;
    /// use hyper_util::client::legacy::Client;
    /// use hyper_util::rt::TokioExecutor;
    /// use tower_idempotency::testing::SideEffectService;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> std::io::Result<()> {
    /// let provider = SideEffectService::new();
    /// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    /// let server = provider.clone().serve(listener).await?;
    ///
    /// let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    /// let req = http::Request::post(server.uri("/charges"))
    ///     .header("idempotency-key", "order-42")
    ///     .body(Full::new(Bytes::from_static(b"{\"amount\":4200}")))
    ///     .unwrap();
    /// let res = client.request(req).await.unwrap();
    /// assert_eq!(res.status(), http::StatusCode::CREATED);
    /// assert_eq!(provider.effects_for_key("order-42"), 1);
    ///
    /// server.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn serve(self, listener: TcpListener) -> io::Result<ServeHandle> {
        let local_addr = listener.local_addr()?;
        let task = tokio::spawn(accept_loop(self, listener));
        Ok(ServeHandle { local_addr, task })
    }
}

/// A running [`SideEffectService::serve`] server; dropping it stops the server.
///
/// Stopping closes the listener and every open connection, including responses held open
/// by [`Fault::CommitThenTimeout`](super::Fault::CommitThenTimeout).
pub struct ServeHandle {
    local_addr: SocketAddr,
    task: JoinHandle<()>,
}

impl ServeHandle {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// An absolute `http://` URI for `path_and_query` on this server, e.g.
    /// `server.uri("/charges?currency=eur")`.
    ///
    /// # Panics
    ///
    /// When `path_and_query` does not start with `/` or is not a valid URI path and query.
    pub fn uri(&self, path_and_query: &str) -> Uri {
        assert!(
            path_and_query.starts_with('/'),
            "a path and query starts with `/`, got {path_and_query:?}"
        );
        format!("http://{}{path_and_query}", self.local_addr)
            .parse()
            .unwrap_or_else(|err| panic!("invalid path and query {path_and_query:?}: {err}"))
    }

    /// Stop the server and wait until its listener and connections are closed.
    pub async fn shutdown(mut self) {
        self.task.abort();
        // The only outcome left is "cancelled" (the accept loop never returns or panics).
        let _ = (&mut self.task).await;
    }
}

impl Drop for ServeHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl fmt::Debug for ServeHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServeHandle")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

async fn accept_loop(provider: SideEffectService, listener: TcpListener) {
    // Connections live in a `JoinSet` owned by this task, so aborting the task (shutdown,
    // drop) aborts every connection with it instead of leaving hung responses behind.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    connections.spawn(serve_connection(provider.clone(), stream));
                }
                Err(err) => {
                    // Per-connection failures (a reset before accept, too many open files)
                    // must not end the server; pause briefly so a persistent one cannot spin.
                    tracing::debug!(%err, "SideEffectService: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            // Reap finished connections so the set does not grow with every one served;
            // a connection that panicked (`Fault::Panic`) has simply been dropped.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve_connection(provider: SideEffectService, stream: TcpStream) {
    let service = hyper::service::service_fn(move |req| {
        // Our `poll_ready` is always ready, so calling a fresh clone directly is sound.
        provider.clone().call(req)
    });
    // No header-read timeout: hyper would need a timer for it, and under a paused test
    // clock an idle keep-alive connection would see it fire at once. An error from the
    // service (a refused call) makes hyper close the connection without answering.
    let result = http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(TokioIo::new(stream), service)
        .await;
    if let Err(err) = result {
        tracing::debug!(%err, "SideEffectService: connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::{Request, StatusCode};
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    use super::super::Fault;
    use super::*;

    fn charge(server: &ServeHandle, key: &str) -> Request<Full<Bytes>> {
        Request::post(server.uri("/charges"))
            .header("idempotency-key", format!("\"{key}\""))
            .body(Full::new(Bytes::from_static(b"{\"amount\":4200}")))
            .unwrap()
    }

    async fn loopback(provider: &SideEffectService) -> ServeHandle {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        provider.clone().serve(listener).await.unwrap()
    }

    #[tokio::test]
    async fn serves_commits_and_commit_then_timeout_over_loopback() {
        let provider = SideEffectService::new();
        let server = loopback(&provider).await;
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

        let res = client.request(charge(&server, "order-1")).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["effect_id"], "eff_1");
        assert_eq!(body["key"], "order-1");
        let attempt = &provider.attempts()[0];
        assert_eq!(attempt.uri().path(), "/charges");
        assert_eq!(attempt.body(), &Bytes::from_static(b"{\"amount\":4200}"));

        provider.reset();
        provider.push_fault(Fault::CommitThenTimeout);
        let lost = tokio::time::timeout(
            Duration::from_millis(300),
            client.request(charge(&server, "order-2")),
        )
        .await;
        assert!(lost.is_err(), "the client's timeout must fire");
        assert_eq!(provider.effects(), 1);
        assert_eq!(provider.effects_for_key("order-2"), 1);

        // The retry, on a fresh connection, is replayed by the provider.
        let res = client.request(charge(&server, "order-2")).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        assert_eq!(res.headers()["idempotent-replayed"], "true");
        assert_eq!(provider.effects(), 1);

        server.shutdown().await;
    }

    #[tokio::test]
    async fn refuse_and_panic_close_the_connection_without_an_answer() {
        let provider = SideEffectService::new().with_faults([
            Fault::RefuseBeforeSend,
            Fault::Panic {
                after_commit: false,
            },
        ]);
        let server = loopback(&provider).await;
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

        let refused = client.request(charge(&server, "k")).await.unwrap_err();
        assert!(
            !refused.is_connect(),
            "the request was already written: {refused:?}"
        );
        let died = client.request(charge(&server, "k")).await.unwrap_err();
        assert!(!died.is_connect(), "{died:?}");
        assert_eq!(provider.effects(), 0);
        assert_eq!(provider.calls(), 2);

        let res = client.request(charge(&server, "k")).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        assert_eq!(provider.effects_for_key("k"), 1);
    }

    #[tokio::test]
    async fn shutdown_closes_the_port() {
        let provider = SideEffectService::new();
        let server = loopback(&provider).await;
        let addr = server.local_addr();
        server.shutdown().await;
        let err = TcpStream::connect(addr).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
    }
}
