//! Test support: a private `redis-server` per test, killed when the test ends.
//!
//! Use it from any test module:
//!
//! ```ignore
//! use crate::support::redis as redis_support;
//!
//! #[tokio::test]
//! async fn uses_redis() {
//!     // `REDIS_URL` when set, otherwise a private server; `None` means "skip".
//!     let Some(redis) = redis_support::redis_url().await else { return };
//!     let url = redis.url();
//!     # let _ = url;
//! }
//! ```
//!
//! - [`redis_url`] gives a URL to run against: `REDIS_URL` when it is set, otherwise a
//!   private server. Tests using it must not assume an empty database (use fresh keys or a
//!   random prefix): `REDIS_URL` may point at a shared instance.
//! - [`RedisServer::spawn`] always starts a private server, for tests that kill, restart,
//!   pause it or read its statistics.
//! - When `redis-server` is not installed both return `None` after a loud notice on stderr,
//!   and the test should return early; with `REQUIRE_REDIS=1` they panic instead, so CI
//!   cannot pass by skipping. `REDIS_SERVER_BIN` names another binary.
//!
//! The machine's own Redis (127.0.0.1:6379, if any) is never used implicitly: private
//! servers listen on a free loopback port, with persistence off.
//!
//! Only the standard library and tokio are used, so any test module can use it
//! whatever features it is built with.
#![allow(dead_code)]

use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a fresh server may take to answer `PING`.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A URL to test against, and the private server behind it, if any.
#[derive(Debug)]
pub struct RedisHandle {
    url: String,
    server: Option<RedisServer>,
}

impl RedisHandle {
    /// `redis://127.0.0.1:<port>/` for a private server, or `REDIS_URL` as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The private server, when the URL is not `REDIS_URL`'s.
    pub fn server(&mut self) -> Option<&mut RedisServer> {
        self.server.as_mut()
    }
}

/// `REDIS_URL` when set, otherwise a private server (see the module docs). `None`: skip.
pub async fn redis_url() -> Option<RedisHandle> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        if !url.is_empty() {
            return Some(RedisHandle { url, server: None });
        }
    }
    let server = RedisServer::spawn().await?;
    Some(RedisHandle {
        url: server.url(),
        server: Some(server),
    })
}

/// A `redis-server` child process on a loopback port, killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    /// With `appendonly yes` and `appendfsync always`, the directory of its log.
    durable: Option<std::path::PathBuf>,
}

impl RedisServer {
    /// Start a private server on a free loopback port (see the module docs). `None`: skip.
    pub async fn spawn() -> Option<Self> {
        Self::spawn_with(None).await
    }

    /// Start a private server that fsyncs every write to an append-only file before it
    /// answers (`appendfsync always`), so a [`restart`](Self::restart) keeps every record it
    /// acknowledged: the setting the ledger's docs recommend.
    pub async fn spawn_durable() -> Option<Self> {
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-redis-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("create the append-only file's directory");
        Self::spawn_with(Some(dir)).await
    }

    async fn spawn_with(durable: Option<std::path::PathBuf>) -> Option<Self> {
        // Picking a free port and binding it are two steps; another process may take the port
        // in between. Retry with another port if the server does not come up.
        for _ in 0..5 {
            let port = free_port();
            let mut server = Self {
                port,
                child: None,
                durable: durable.clone(),
            };
            match server.start_child() {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                    skip_notice(&format!("`{}` was not found", binary()));
                    return None;
                }
                Err(err) => panic!("could not run `{}`: {err}", binary()),
            }
            if server.wait_until_ready().await {
                return Some(server);
            }
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The loopback port it listens on (the same after a [`restart`](Self::restart)).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kill the server with `SIGKILL`, like a crash: no shutdown, nothing saved.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start the server again on the same port (empty: persistence is off).
    pub async fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + START_TIMEOUT;
        // The port was just released; retry briefly in case the kernel still holds it.
        loop {
            self.start_child().expect("restart redis-server");
            if self.wait_until_ready().await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not restart on port {}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Freeze the server (`SIGSTOP`): connections stay open, nothing is answered.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Undo [`pause`](Self::pause) (`SIGCONT`).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the server is running");
        let status = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }

    fn start_child(&mut self) -> std::io::Result<()> {
        let mut command = Command::new(binary());
        command
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"]);
        match &self.durable {
            Some(dir) => command
                .args([
                    "--save",
                    "",
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                ])
                .args(["--dir", &dir.to_string_lossy()]),
            // No snapshots, no append-only file: nothing is written, nothing survives a kill.
            None => command
                .args(["--save", "", "--appendonly", "no"])
                .args(["--dir", &std::env::temp_dir().to_string_lossy()]),
        };
        let child = command
            .args(["--daemonize", "no", "--loglevel", "warning"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// Poll with `PING` until the server answers; `false` if it exited or never answered.
    async fn wait_until_ready(&mut self) -> bool {
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            let exited = match self.child.as_mut() {
                Some(child) => child
                    .try_wait()
                    .map(|status| status.is_some())
                    .unwrap_or(true),
                None => true,
            };
            if exited {
                // Most likely the port was taken between choosing and binding it.
                self.child = None;
                return false;
            }
            if ping(self.port).await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop();
        false
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL also ends a paused (SIGSTOPped) server.
        self.stop();
        if let Some(dir) = &self.durable {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn binary() -> String {
    std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".to_owned())
}

fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a loopback port");
    listener.local_addr().expect("local address").port()
}

async fn ping(port: u16) -> bool {
    let attempt = async {
        let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await.ok()?;
        stream.write_all(b"PING\r\n").await.ok()?;
        let mut reply = [0u8; 7];
        stream.read_exact(&mut reply).await.ok()?;
        Some(&reply == b"+PONG\r\n")
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(500), attempt).await,
        Ok(Some(true))
    )
}

fn skip_notice(why: &str) {
    if std::env::var("REQUIRE_REDIS").is_ok_and(|value| value == "1") {
        panic!("REQUIRE_REDIS=1 but {why}: install redis-server or set REDIS_SERVER_BIN");
    }
    // Straight to the process's stderr: the test harness captures `eprintln!` of passing
    // tests, and a skip must be seen.
    let _ = writeln!(
        std::io::stderr(),
        "\n\
         ************************************************************************\n\
         *** SKIPPING a Redis test: {why}.\n\
         *** Install redis-server (or set REDIS_SERVER_BIN) to run it;\n\
         *** set REQUIRE_REDIS=1 to turn this skip into a failure.\n\
         ************************************************************************\n"
    );
}

/// Run `case` on a fresh current-thread runtime in real time (Redis judges leases by its
/// own clock) against a `RedisStore` whose keys carry a prefix of their own (`label`, the
/// process and a random number), so runs never see each other's records; skipped (loudly)
/// without `redis-server`.
#[cfg(feature = "redis")]
pub fn on_redis<F: std::future::Future<Output = ()>>(
    label: &str,
    case: impl FnOnce(std::sync::Arc<dyn tower_idempotency::ledger::IdempotencyStore>) -> F,
) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let Some(redis) = redis_url().await else {
            return;
        };
        let prefix = format!("{label}:{}:{}:", std::process::id(), fastrand::u64(..));
        let store = tower_idempotency::ledger::RedisStore::builder(redis.url())
            .prefix(prefix)
            .connect()
            .await
            .unwrap();
        case(std::sync::Arc::new(store)).await;
    });
}
