//! Test support: a private Redis Cluster per test binary (or per test), killed when dropped.
//!
//! ```ignore
//! use crate::support::redis_cluster as cluster_support;
//!
//! #[tokio::test]
//! async fn uses_a_cluster() {
//!     // Three primaries, no replicas; `None` means "skip".
//!     let Some(cluster) = cluster_support::RedisCluster::spawn(3, 0).await else { return };
//!     let urls = cluster.urls();
//!     # let _ = urls;
//! }
//! ```
//!
//! Each node is a `redis-server --cluster-enabled yes` on a free loopback port (and a free
//! cluster-bus port), persistence off, its files in a temporary directory of its own; the
//! nodes are joined with `redis-cli --cluster create … --cluster-yes`, and `spawn` returns
//! once every node says `cluster_state:ok` and every replica is in sync with its primary.
//!
//! When `redis-server` or `redis-cli` is missing, `spawn` returns `None` after a loud notice
//! on stderr; with `REQUIRE_REDIS=1` it panics instead, so CI cannot pass by skipping.
//! `REDIS_SERVER_BIN` and `REDIS_CLI_BIN` name other binaries.
#![allow(dead_code)]

use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long the nodes may take to start, join and agree.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a node may go unheard before the others call it failing. Short, so a killed
/// primary is noticed (and failed over) quickly.
const NODE_TIMEOUT_MS: u32 = 1000;

/// A local Redis Cluster: its nodes and their directory, removed on drop.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
    dir: PathBuf,
}

/// One `redis-server` of the cluster.
#[derive(Debug)]
pub struct ClusterNode {
    port: u16,
    bus_port: u16,
    child: Option<Child>,
}

impl RedisCluster {
    /// Start `primaries` primaries with `replicas` replicas each and join them (see the
    /// module docs). `None`: skip.
    pub async fn spawn(primaries: usize, replicas: usize) -> Option<Self> {
        if !found(&server_binary(), "--version") || !found(&cli_binary(), "--version") {
            skip_notice(&format!(
                "`{}` or `{}` was not found",
                server_binary(),
                cli_binary()
            ));
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-cluster-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("create the cluster's directory");
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
        };
        for _ in 0..primaries * (1 + replicas) {
            let node = cluster.start_node().await;
            cluster.nodes.push(node);
        }
        cluster.shut_down_when_this_process_exits();
        cluster.create(replicas);
        cluster.wait_until_healthy().await;
        Some(cluster)
    }

    /// One cluster of three primaries for the whole test binary, started by the first test
    /// that asks. For tests that neither kill, pause nor reshard it, and that keep to keys of
    /// their own (a prefix per test). `None`: skip.
    pub async fn shared() -> Option<&'static Self> {
        static SHARED: tokio::sync::OnceCell<Option<RedisCluster>> =
            tokio::sync::OnceCell::const_new();
        SHARED.get_or_init(|| Self::spawn(3, 0)).await.as_ref()
    }

    /// A static is never dropped, and a test binary that panics may not unwind: a small
    /// watchdog shuts the nodes down (by port, with `SHUTDOWN NOSAVE`, so it can only ever
    /// reach these servers) and removes their directory once this process is gone.
    fn shut_down_when_this_process_exits(&self) {
        let mut script = format!(
            "while kill -0 {} 2>/dev/null; do sleep 0.2; done;",
            std::process::id()
        );
        for node in &self.nodes {
            script += &format!(
                " '{}' -h 127.0.0.1 -p {} shutdown nosave >/dev/null 2>&1;",
                cli_binary(),
                node.port
            );
        }
        script += &format!(" rm -rf '{}'", self.dir.to_string_lossy());
        // Never waited for: the watchdog's whole job is to outlive this process.
        #[allow(clippy::zombie_processes)]
        let _watchdog = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the cluster's watchdog");
    }

    /// `redis://127.0.0.1:<port>/` of every node, in start order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|node| node.url()).collect()
    }

    /// The nodes, in start order.
    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    /// The node listening on `port`.
    pub fn node(&self, port: u16) -> &ClusterNode {
        self.nodes
            .iter()
            .find(|node| node.port == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    /// The ports of the nodes that serve slots now, as seen by `from`.
    pub fn primaries(&self, from: u16) -> Vec<u16> {
        self.topology(from)
            .into_iter()
            .filter(|line| line.flags.contains("master") && !line.flags.contains("fail"))
            .map(|line| line.port)
            .collect()
    }

    /// The port of the replica of `primary`, as seen by `from`.
    pub fn replica_of(&self, primary: u16, from: u16) -> Option<u16> {
        let topology = self.topology(from);
        let primary_id = topology
            .iter()
            .find(|line| line.port == primary)?
            .id
            .clone();
        topology
            .into_iter()
            .find(|line| line.primary_id == primary_id && line.flags.contains("slave"))
            .map(|line| line.port)
    }

    /// Kill the node on `port` with `SIGKILL`, like a crash: no shutdown, nothing saved.
    pub fn kill(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|node| node.port == port)
            .expect("a node of this cluster");
        node.stop();
    }

    /// Freeze the node on `port` (`SIGSTOP`): its connections stay open, nothing is answered
    /// and nothing is replicated to or from it.
    pub fn pause(&self, port: u16) {
        self.node(port).signal("-STOP");
    }

    /// Undo [`pause`](Self::pause) (`SIGCONT`).
    pub fn resume(&self, port: u16) {
        self.node(port).signal("-CONT");
    }

    /// Wait until every running node says `cluster_state:ok`, agrees on one configuration
    /// and every running replica's link to its primary is up.
    pub async fn wait_until_healthy(&self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if self.is_healthy() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not become healthy within {START_TIMEOUT:?}:\n{}",
                self.running()
                    .map(|node| format!("{}: {}", node.port, cli(node.port, &["cluster", "nodes"])))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn is_healthy(&self) -> bool {
        let mut views = Vec::new();
        for node in self.running() {
            if !cli(node.port, &["cluster", "info"]).contains("cluster_state:ok") {
                return false;
            }
            let replication = cli(node.port, &["info", "replication"]);
            if replication.contains("role:slave") && !replication.contains("master_link_status:up")
            {
                return false;
            }
            let mut view: Vec<String> = self
                .topology(node.port)
                .into_iter()
                .filter(|line| !line.flags.contains("fail"))
                .map(|line| format!("{} {} {}", line.port, line.role(), line.slots))
                .collect();
            view.sort();
            views.push(view);
        }
        views.windows(2).all(|pair| pair[0] == pair[1])
    }

    fn running(&self) -> impl Iterator<Item = &ClusterNode> {
        self.nodes.iter().filter(|node| node.child.is_some())
    }

    /// `CLUSTER NODES` as seen by `from`.
    fn topology(&self, from: u16) -> Vec<NodeLine> {
        cli(from, &["cluster", "nodes"])
            .lines()
            .filter_map(NodeLine::parse)
            .collect()
    }

    async fn start_node(&self) -> ClusterNode {
        // Choosing free ports and binding them are two steps; another process may take one
        // in between. Retry with other ports if the server does not come up.
        for _ in 0..5 {
            let mut node = ClusterNode {
                port: free_port(),
                bus_port: free_port(),
                child: None,
            };
            node.start(&self.dir);
            if node.wait_until_ready().await {
                return node;
            }
        }
        panic!("a cluster node did not start on any of 5 free ports");
    }

    fn create(&self, replicas: usize) {
        let mut command = Command::new(cli_binary());
        command.arg("--cluster").arg("create");
        for node in &self.nodes {
            command.arg(format!("127.0.0.1:{}", node.port));
        }
        let output = command
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            // SIGKILL also ends a paused (SIGSTOPped) node.
            node.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl ClusterNode {
    /// Its client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn start(&mut self, dir: &std::path::Path) {
        let config_file = dir.join(format!("nodes-{}.conf", self.port));
        let child = Command::new(server_binary())
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-port", &self.bus_port.to_string()])
            .args(["--cluster-config-file", &config_file.to_string_lossy()])
            .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
            // No snapshots, no append-only file: nothing survives a kill.
            .args(["--save", "", "--appendonly", "no"])
            .args(["--dir", &dir.to_string_lossy()])
            .args(["--daemonize", "no", "--loglevel", "warning"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| panic!("could not run `{}`: {err}", server_binary()));
        self.child = Some(child);
    }

    async fn wait_until_ready(&mut self) -> bool {
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            let exited = self
                .child
                .as_mut()
                .is_none_or(|child| child.try_wait().map_or(true, |status| status.is_some()));
            if exited {
                self.child = None;
                return false;
            }
            if cli(self.port, &["ping"]).trim() == "PONG" {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop();
        false
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("the node is running").id();
        let status = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }
}

/// One line of `CLUSTER NODES`.
#[derive(Debug)]
struct NodeLine {
    id: String,
    port: u16,
    flags: String,
    primary_id: String,
    slots: String,
}

impl NodeLine {
    fn parse(line: &str) -> Option<Self> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // <id> <ip:port@bus> <flags> <primary> <ping> <pong> <epoch> <link> <slot>...
        let address = fields.get(1)?;
        let port = address
            .split('@')
            .next()?
            .rsplit(':')
            .next()?
            .parse()
            .ok()?;
        Some(Self {
            id: fields.first()?.to_string(),
            port,
            flags: fields.get(2)?.to_string(),
            primary_id: fields.get(3)?.to_string(),
            slots: fields
                .get(8..)
                .map(|slots| slots.join(" "))
                .unwrap_or_default(),
        })
    }

    fn role(&self) -> &'static str {
        if self.flags.contains("master") {
            "primary"
        } else {
            "replica"
        }
    }
}

/// Run `redis-cli -p <port> <args>` and return what it printed ("" when it could not run).
pub fn cli(port: u16, args: &[&str]) -> String {
    Command::new(cli_binary())
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
        .unwrap_or_default()
}

fn found(binary: &str, arg: &str) -> bool {
    Command::new(binary)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn server_binary() -> String {
    std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".to_owned())
}

fn cli_binary() -> String {
    std::env::var("REDIS_CLI_BIN").unwrap_or_else(|_| "redis-cli".to_owned())
}

fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a loopback port");
    listener.local_addr().expect("local address").port()
}

fn skip_notice(why: &str) {
    if std::env::var("REQUIRE_REDIS").is_ok_and(|value| value == "1") {
        panic!(
            "REQUIRE_REDIS=1 but {why}: install redis-server and redis-cli (redis-tools), or \
             set REDIS_SERVER_BIN and REDIS_CLI_BIN"
        );
    }
    // Straight to the process's stderr: the test harness captures `eprintln!` of passing
    // tests, and a skip must be seen.
    let _ = writeln!(
        std::io::stderr(),
        "\n\
         ************************************************************************\n\
         *** SKIPPING a Redis Cluster test: {why}.\n\
         *** Install redis-server and redis-cli (or set REDIS_SERVER_BIN and\n\
         *** REDIS_CLI_BIN) to run it; set REQUIRE_REDIS=1 to make this a failure.\n\
         ************************************************************************\n"
    );
}
