//! Test support: a private PostgreSQL server per test, stopped when the test ends.
//!
//! Use it from any test module:
//!
//! ```ignore
//! use crate::support::postgres as postgres_support;
//!
//! #[tokio::test]
//! async fn uses_postgres() {
//!     // `DATABASE_URL` when set, otherwise a private server; `None` means "skip".
//!     let Some(pg) = postgres_support::postgres_url().await else { return };
//!     let (url, schema) = (pg.url(), postgres_support::fresh_schema());
//!     # let _ = (url, schema);
//! }
//! ```
//!
//! - [`postgres_url`] gives a URL to run against: `DATABASE_URL` when it is set, otherwise a
//!   private server. Tests must not assume an empty database: each uses its own schema
//!   ([`fresh_schema`]), since `DATABASE_URL` may point at a shared one.
//! - [`PostgresServer::spawn`] always starts a private server (for tests that kill,
//!   restart, pause it or read its log): `initdb` in a temporary
//!   directory, then `pg_ctl start` on a free loopback port (no Unix socket in a shared
//!   place), with `fsync` off (a test's data need not survive a power cut). PostgreSQL
//!   refuses to run as root, so under root both run as the `postgres` user (`runuser`).
//! - When the binaries are not found both return `None` after a loud notice on stderr, and
//!   the test should return early; with `REQUIRE_POSTGRES=1` they panic instead, so CI
//!   cannot pass by skipping. `PG_BIN_DIR` names the directory of `initdb` and `pg_ctl`
//!   (default: the newest `/usr/lib/postgresql/*/bin`, else `$PATH`).
//!
//! The machine's own PostgreSQL (127.0.0.1:5432, if any) is never used implicitly.
//!
//! Only the standard library and tokio are used, so any test module can use it
//! whatever features it is built with.
#![allow(dead_code)]

use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// A URL to test against, and the private server behind it, if any.
#[derive(Debug)]
pub struct PostgresHandle {
    url: String,
    server: Option<PostgresServer>,
}

impl PostgresHandle {
    /// `postgres://postgres@127.0.0.1:<port>/postgres` for a private server, or
    /// `DATABASE_URL` as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The private server, when the URL is not `DATABASE_URL`'s.
    pub fn server(&mut self) -> Option<&mut PostgresServer> {
        self.server.as_mut()
    }
}

/// A schema name no other test uses.
pub fn fresh_schema() -> String {
    format!("test_{:016x}", fastrand::u64(..))
}

/// `DATABASE_URL` when set, otherwise a private server (see the module docs). `None`: skip.
pub async fn postgres_url() -> Option<PostgresHandle> {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        if !url.is_empty() {
            return Some(PostgresHandle { url, server: None });
        }
    }
    let server = PostgresServer::spawn().await?;
    Some(PostgresHandle {
        url: server.url(),
        server: Some(server),
    })
}

/// A PostgreSQL server on a loopback port, in a temporary directory, stopped on drop.
#[derive(Debug)]
pub struct PostgresServer {
    port: u16,
    dir: PathBuf,
    bin: PathBuf,
}

impl PostgresServer {
    /// Start a private server (see the module docs). `None`: skip.
    pub async fn spawn() -> Option<Self> {
        let Some(bin) = binaries() else {
            skip_notice("initdb and pg_ctl were not found");
            return None;
        };
        let spawned = tokio::task::spawn_blocking(move || Self::spawn_blocking(bin))
            .await
            .expect("spawning PostgreSQL panicked");
        Some(spawned)
    }

    fn spawn_blocking(bin: PathBuf) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-pg-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        ));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        let mut server = Self { port: 0, dir, bin };
        if as_root() {
            // The server's user must own its directory (and reach it).
            run(Command::new("chown").arg("postgres:").arg(&server.dir));
        }
        run(server.command("initdb").arg("-D").arg(server.data()).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
        ]));
        // Choosing a free port and binding it are two steps: retry on another port if the
        // server does not come up.
        for _ in 0..5 {
            server.port = free_port();
            if server.start() {
                return server;
            }
        }
        panic!(
            "PostgreSQL did not start on any of 5 free ports; see {:?}",
            server.log()
        );
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The loopback port it listens on (the same after a [`restart`](Self::restart)).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stop the server at once (`pg_ctl stop -m immediate`: no checkpoint, like a crash;
    /// committed transactions survive through the write-ahead log).
    pub fn stop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }

    /// Start the server again on the same port, with its data.
    pub async fn restart(&mut self) {
        self.stop();
        let again = Self {
            port: self.port,
            dir: self.dir.clone(),
            bin: self.bin.clone(),
        };
        let started = tokio::task::spawn_blocking(move || {
            let started = again.start();
            // Leave the directory to `self`: `again` must not stop the server or remove
            // the directory when dropped.
            std::mem::forget(again);
            started
        })
        .await
        .expect("restarting PostgreSQL panicked");
        assert!(started, "PostgreSQL did not restart on port {}", self.port);
    }

    /// Kill the server and every process of it with `SIGKILL`: no shutdown of any kind,
    /// like a machine losing power (committed transactions survive through the
    /// write-ahead log). [`restart`](Self::restart) brings it back, after crash recovery.
    pub fn kill(&mut self) {
        let processes = self.processes();
        signal("KILL", &processes);
        // Wait until they are dead (gone, or zombies nobody reaped yet), so a restart does
        // not find the old postmaster's shared memory still attached.
        let alive = |pid: &u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                let state = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next());
                !matches!(state, Some("Z" | "X"))
            })
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while processes.iter().any(alive) {
            assert!(
                std::time::Instant::now() < deadline,
                "PostgreSQL's processes outlived SIGKILL"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Freeze the server and every process of it (`SIGSTOP`): connections stay open and
    /// nothing answers, as in a long stall of the machine. Undo with [`resume`](Self::resume).
    pub fn pause(&self) {
        signal("STOP", &self.processes());
    }

    /// Let a [paused](Self::pause) server run again.
    pub fn resume(&self) {
        signal("CONT", &self.processes());
    }

    /// The server's log so far (`ERROR` lines included: PostgreSQL logs every failed
    /// statement).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }

    /// The postmaster and its children: the first line of `postmaster.pid`, and every
    /// process whose parent it is (from `/proc`).
    fn processes(&self) -> Vec<u32> {
        let Some(postmaster) = std::fs::read_to_string(self.data().join("postmaster.pid"))
            .ok()
            .and_then(|pid| pid.lines().next()?.trim().parse::<u32>().ok())
        else {
            return Vec::new();
        };
        let mut processes = vec![postmaster];
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            // `pid (comm) state ppid …`; the command may hold spaces and parentheses.
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let parent = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if parent == Some(postmaster) {
                processes.push(pid);
            }
        }
        processes
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// `pg_ctl start -w`: `true` once the server accepts connections.
    fn start(&self) -> bool {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off -c full_page_writes=off \
             -c max_connections=200",
            self.port,
            self.dir.display()
        );
        self.command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.log())
            .args(["-w", "-t", "30", "-o", &options, "start"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    }

    /// One of the server's binaries, as the `postgres` user when we are root.
    fn command(&self, name: &str) -> Command {
        let program = self.bin.join(name);
        if as_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command
        } else {
            Command::new(program)
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory of `initdb` and `pg_ctl`: `PG_BIN_DIR`, the newest
/// `/usr/lib/postgresql/*/bin`, or the one on `$PATH`.
fn binaries() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN_DIR") {
        return Some(PathBuf::from(dir)).filter(|dir| dir.join("initdb").exists());
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .find(|dir| dir.join("initdb").exists() && dir.join("pg_ctl").exists())
    })
}

fn as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.starts_with(b"0\n"))
}

fn run(command: &mut Command) {
    let output = command.output().expect("run a PostgreSQL binary");
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Send `SIG<name>` to `processes`; those already gone are ignored.
fn signal(name: &str, processes: &[u32]) {
    if processes.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .args(processes.iter().map(u32::to_string))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a loopback port");
    listener.local_addr().expect("local address").port()
}

fn skip_notice(why: &str) {
    if std::env::var("REQUIRE_POSTGRES").is_ok_and(|value| value == "1") {
        panic!("REQUIRE_POSTGRES=1 but {why}: install PostgreSQL, set PG_BIN_DIR or DATABASE_URL");
    }
    // Straight to the process's stderr: the test harness captures `eprintln!` of passing
    // tests, and a skip must be seen.
    let _ = writeln!(
        std::io::stderr(),
        "\n\
         ************************************************************************\n\
         *** SKIPPING a PostgreSQL test: {why}.\n\
         *** Install PostgreSQL (or set PG_BIN_DIR, or DATABASE_URL) to run it;\n\
         *** set REQUIRE_POSTGRES=1 to turn this skip into a failure.\n\
         ************************************************************************\n"
    );
}
