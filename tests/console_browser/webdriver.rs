//! A headless Chromium driven through `chromedriver` with the W3C WebDriver protocol, spoken
//! directly over the hyper client the tests already have: a dozen JSON commands are all the
//! console's tests need, and no WebDriver crate (with its TLS stack) is built for them.
//!
//! - [`Browser::launch`] starts `chromedriver` on a free loopback port and a Chromium session
//!   with a fresh profile; when either binary is missing it returns `None` after a loud
//!   notice on stderr, and the test should return early; with `REQUIRE_CHROMIUM=1` it
//!   panics instead, so CI cannot pass by skipping. `CHROMIUM_BIN` and `CHROMEDRIVER_BIN`
//!   name other binaries.
//! - Every wait polls for what the test expects (an element, a text, an address) up to a
//!   generous deadline, so a loaded machine is slower, not flaky.
//! - Dropping the [`Browser`], on success or in a panic, ends the session, kills
//!   `chromedriver`'s process group and any Chromium process still running on the profile,
//!   and removes the profile; a failing test keeps `chromedriver`'s log and says where.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

/// How long `chromedriver` may take to answer its status, and Chromium to start a session,
/// on a machine busy compiling.
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// How long one WebDriver command may take (a page load included).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(90);

/// How long a wait polls for what the test expects before it fails.
const WAIT_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a wait looks again.
const POLL_EVERY: Duration = Duration::from_millis(100);

/// The window's size: modest, so screenshots stay small enough to commit.
const WINDOW: (u32, u32) = (1200, 820);

/// The key W3C WebDriver names a found element by.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A Chromium session, and the processes and files behind it.
pub struct Browser {
    client: Client<HttpConnector, Full<Bytes>>,
    /// `http://127.0.0.1:PORT/session/ID`.
    session: String,
    /// Held for its drop, which ends them.
    _processes: Processes,
}

/// A found element.
#[derive(Clone, Debug)]
pub struct Element {
    id: String,
}

/// A WebDriver command's error: its `error` code and message (or the transport's).
#[derive(Debug)]
pub struct WebDriverError {
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for WebDriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl Browser {
    /// Start `chromedriver` and a headless Chromium session; `None` (after a loud notice)
    /// when either is not installed.
    pub async fn launch() -> Option<Browser> {
        let chromium = binary("CHROMIUM_BIN", &["chromium", "chromium-browser"])?;
        let chromedriver = binary("CHROMEDRIVER_BIN", &["chromedriver"])?;
        let mut processes = Processes::start(&chromedriver);
        let client = Client::builder(TokioExecutor::new()).build_http();
        wait_until_ready(&client, &mut processes).await;
        let capabilities = capabilities(&chromium, &processes.profile);
        let created = command(
            &client,
            Method::POST,
            &format!("{}/session", processes.driver),
            Some(capabilities),
            START_TIMEOUT,
        )
        .await
        .unwrap_or_else(|err| {
            panic!(
                "Chromium did not start: {err}; chromedriver's log: {}",
                processes.log.display()
            )
        });
        let id = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a new session names itself: {created}"))
            .to_owned();
        processes.session = Some(id.clone());
        Some(Browser {
            client,
            session: format!("{}/session/{id}", processes.driver),
            _processes: processes,
        })
    }

    async fn command(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, WebDriverError> {
        command(
            &self.client,
            method,
            &format!("{}{path}", self.session),
            body,
            COMMAND_TIMEOUT,
        )
        .await
        .map(|answer| answer["value"].clone())
    }

    /// Open `url` and wait for it to load.
    pub async fn go(&self, url: &str) {
        self.command(Method::POST, "/url", Some(json!({ "url": url })))
            .await
            .unwrap_or_else(|err| panic!("navigating to {url}: {err}"));
    }

    /// The address of the page shown.
    pub async fn url(&self) -> String {
        let url = self.command(Method::GET, "/url", None).await.unwrap();
        url.as_str().unwrap_or_default().to_owned()
    }

    /// Set a cookie on the origin of the page shown.
    pub async fn add_cookie(&self, name: &str, value: &str) {
        let cookie = json!({ "cookie": { "name": name, "value": value, "path": "/" } });
        self.command(Method::POST, "/cookie", Some(cookie))
            .await
            .unwrap_or_else(|err| panic!("setting the cookie {name}: {err}"));
    }

    /// The first element matching the CSS `selector`, waited for.
    pub async fn find(&self, selector: &str) -> Element {
        let query = json!({ "using": "css selector", "value": selector });
        let found = self
            .poll(&format!("an element matching `{selector}`"), || async {
                self.command(Method::POST, "/element", Some(query.clone()))
                    .await
                    .ok()
            })
            .await;
        Element {
            id: found[ELEMENT].as_str().unwrap().to_owned(),
        }
    }

    /// The text of the first element matching `selector`, once it contains `expected`.
    pub async fn wait_for_text(&self, selector: &str, expected: &str) -> String {
        self.poll(
            &format!("`{selector}` to say {expected:?}"),
            || async move {
                let element = self.try_find(selector).await?;
                let text = self.text(&element).await.ok()?;
                text.contains(expected).then_some(text)
            },
        )
        .await
    }

    /// Wait until the page shown is at an address containing `part`; the address.
    pub async fn wait_for_url(&self, part: &str) -> String {
        self.poll(&format!("an address containing {part:?}"), || async move {
            let url = self.url().await;
            url.contains(part).then_some(url)
        })
        .await
    }

    async fn try_find(&self, selector: &str) -> Option<Element> {
        let query = json!({ "using": "css selector", "value": selector });
        let found = self
            .command(Method::POST, "/element", Some(query))
            .await
            .ok()?;
        Some(Element {
            id: found[ELEMENT].as_str()?.to_owned(),
        })
    }

    /// Ask `attempt` until it answers, up to [`WAIT_TIMEOUT`]; on timeout, fail with what was
    /// awaited and the page as it is.
    async fn poll<T, F, Fut>(&self, awaited: &str, mut attempt: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + WAIT_TIMEOUT;
        loop {
            if let Some(answer) = attempt().await {
                return answer;
            }
            if Instant::now() > deadline {
                let url = self.url().await;
                let page = self
                    .command(Method::GET, "/source", None)
                    .await
                    .map(|source| source.as_str().unwrap_or_default().to_owned())
                    .unwrap_or_default();
                panic!("waited {WAIT_TIMEOUT:?} for {awaited} at {url}; the page:\n{page}");
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// The rendered text of `element`.
    pub async fn text(&self, element: &Element) -> Result<String, WebDriverError> {
        let text = self
            .command(Method::GET, &format!("/element/{}/text", element.id), None)
            .await?;
        Ok(text.as_str().unwrap_or_default().to_owned())
    }

    /// Click `element` as a person would (scrolled into view, the topmost thing there).
    pub async fn click(&self, element: &Element) {
        self.command(
            Method::POST,
            &format!("/element/{}/click", element.id),
            Some(json!({})),
        )
        .await
        .unwrap_or_else(|err| panic!("clicking {element:?}: {err}"));
    }

    /// Type `text` into `element`, key by key.
    pub async fn type_into(&self, element: &Element, text: &str) {
        self.command(
            Method::POST,
            &format!("/element/{}/value", element.id),
            Some(json!({ "text": text })),
        )
        .await
        .unwrap_or_else(|err| panic!("typing into {element:?}: {err}"));
    }

    /// Resize the window to `width` by `height` (the page shown gets less: headless Chromium
    /// keeps room for the window's frame).
    pub async fn resize(&self, width: u32, height: u32) {
        let rect = json!({ "width": width, "height": height });
        self.command(Method::POST, "/window/rect", Some(rect))
            .await
            .unwrap_or_else(|err| panic!("resizing the window: {err}"));
    }

    /// A PNG of the window, saved to `path` (its directory created).
    pub async fn screenshot(&self, path: &Path) {
        let png = self
            .command(Method::GET, "/screenshot", None)
            .await
            .unwrap();
        let png = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap_or_default())
            .expect("a screenshot is base64");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

/// What the session asks of Chromium: headless, sandboxed by the container rather than by
/// itself, and quiet on the network (this machine's closed network refuses the connections
/// a browser makes on its own), with a profile of its own.
fn capabilities(chromium: &Path, profile: &Path) -> Value {
    let (width, height) = WINDOW;
    json!({
        "capabilities": {
            "alwaysMatch": {
                "browserName": "chrome",
                "pageLoadStrategy": "normal",
                "timeouts": { "implicit": 0, "pageLoad": 60_000, "script": 30_000 },
                "goog:chromeOptions": {
                    "binary": chromium,
                    "args": [
                        "--headless",
                        "--no-sandbox",
                        "--disable-gpu",
                        "--disable-quic",
                        "--no-first-run",
                        "--disable-background-networking",
                        "--disable-component-update",
                        "--disable-sync",
                        "--disable-dev-shm-usage",
                        "--hide-scrollbars",
                        "--force-device-scale-factor=1",
                        format!("--window-size={width},{height}"),
                        format!("--user-data-dir={}", profile.display()),
                    ],
                },
            },
        },
    })
}

/// Send one command; the answer's JSON, or the WebDriver error it carries.
async fn command(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: Method,
    url: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, WebDriverError> {
    let mut request = Request::builder().method(method).uri(url);
    let body = match body {
        Some(body) => {
            request = request.header("content-type", "application/json; charset=utf-8");
            Bytes::from(body.to_string())
        }
        None => Bytes::new(),
    };
    let transport = |message: String| WebDriverError {
        code: "transport".to_owned(),
        message,
    };
    let exchange = async {
        let response = client
            .request(request.body(Full::new(body)).unwrap())
            .await
            .map_err(|err| transport(err.to_string()))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|err| transport(err.to_string()))?
            .to_bytes();
        let answer: Value = serde_json::from_slice(&bytes)
            .map_err(|err| transport(format!("{err}: {}", String::from_utf8_lossy(&bytes))))?;
        if status.is_success() {
            Ok(answer)
        } else {
            Err(WebDriverError {
                code: answer["value"]["error"]
                    .as_str()
                    .unwrap_or("unknown")
                    .to_owned(),
                message: answer["value"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            })
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| Err(transport(format!("no answer in {timeout:?}"))))
}

/// Poll `chromedriver`'s status until it is ready; fail with its log if it exits or never is.
async fn wait_until_ready(client: &Client<HttpConnector, Full<Bytes>>, processes: &mut Processes) {
    let deadline = Instant::now() + START_TIMEOUT;
    let status = format!("{}/status", processes.driver);
    loop {
        if let Ok(answer) = command(client, Method::GET, &status, None, POLL_EVERY * 10).await {
            if answer["value"]["ready"] == true {
                return;
            }
        }
        if let Ok(Some(exit)) = processes.chromedriver.try_wait() {
            panic!(
                "chromedriver exited ({exit}): {}",
                std::fs::read_to_string(&processes.log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "chromedriver not ready in {START_TIMEOUT:?}: {}",
            std::fs::read_to_string(&processes.log).unwrap_or_default()
        );
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// `chromedriver` (in a process group of its own), the scratch directory with Chromium's
/// profile and the driver's log, and the session, ended on drop.
struct Processes {
    chromedriver: Child,
    /// `http://127.0.0.1:PORT`.
    driver: String,
    port: u16,
    scratch: PathBuf,
    profile: PathBuf,
    log: PathBuf,
    session: Option<String>,
}

impl Processes {
    fn start(chromedriver: &Path) -> Processes {
        let scratch = std::env::temp_dir().join(format!(
            "console-browser-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        let profile = scratch.join("profile");
        std::fs::create_dir_all(&profile).unwrap();
        let log = scratch.join("chromedriver.log");
        let port = free_port();
        let chromedriver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Chromium inherits the group, so one signal to it reaches them all.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|err| panic!("spawning {}: {err}", chromedriver.display()));
        Processes {
            chromedriver,
            driver: format!("http://127.0.0.1:{port}"),
            port,
            scratch,
            profile,
            log,
            session: None,
        }
    }

    /// `DELETE` the session with a blocking request (drop cannot await): Chromium closes
    /// its windows and exits.
    fn end_session(&self, session: &str) {
        let Ok(mut stream) = TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)) else {
            return;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(20)));
        let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
        let _ = write!(
            stream,
            "DELETE /session/{session} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        );
        // Read the answer whole, but no further: chromedriver keeps the connection open.
        let mut answer = Vec::new();
        let mut chunk = [0u8; 4096];
        while !is_whole(&answer) {
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(read) => answer.extend_from_slice(&chunk[..read]),
            }
        }
    }

    /// Kill what still runs on the profile, by process id: a Chromium that outlived its
    /// driver's group (its zygote may start a session of its own).
    fn kill_strays(&self) {
        let marker = format!("--user-data-dir={}", self.profile.display());
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let runs_on_profile = cmdline
                .split(|byte| *byte == 0)
                .any(|arg| arg == marker.as_bytes());
            if runs_on_profile {
                signal(&pid.to_string());
            }
        }
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            self.end_session(&session);
        }
        signal(&format!("-{}", self.chromedriver.id()));
        let _ = self.chromedriver.wait();
        self.kill_strays();
        if std::thread::panicking() {
            eprintln!("chromedriver's log is kept at {}", self.log.display());
            let _ = std::fs::remove_dir_all(&self.profile);
        } else {
            let _ = std::fs::remove_dir_all(&self.scratch);
        }
    }
}

/// Whether `answer` holds an HTTP response's head and all the body its `Content-Length` says.
fn is_whole(answer: &[u8]) -> bool {
    let Some(end) = answer.windows(4).position(|window| window == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|length| length.trim().parse::<usize>().ok())
        .unwrap_or(0);
    answer.len() >= end + 4 + length
}

/// `kill -KILL -- target`: a process id, or `-pgid` for a group.
fn signal(target: &str) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", target])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// A loopback port free a moment ago, for `chromedriver` to listen on.
fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    listener.local_addr().unwrap().port()
}

/// The binary the environment variable `variable` names, or the first of `names` on `PATH`;
/// `None` after a loud notice (a panic with `REQUIRE_CHROMIUM=1`) when there is none.
fn binary(variable: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(variable) {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = names.iter().find_map(|name| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    });
    if found.is_none() {
        skip_notice(&format!("{} is not installed", names[0]));
    }
    found
}

fn skip_notice(why: &str) {
    if std::env::var("REQUIRE_CHROMIUM").is_ok_and(|value| value == "1") {
        panic!(
            "REQUIRE_CHROMIUM=1 but {why}: install chromium and chromium-driver \
             (or set CHROMIUM_BIN and CHROMEDRIVER_BIN)"
        );
    }
    // Straight to the process's stderr: the test harness captures `eprintln!` of passing
    // tests, and a skip must be seen.
    let _ = writeln!(
        std::io::stderr(),
        "\n\
         ************************************************************************\n\
         *** SKIPPING a browser test: {why}.\n\
         *** Install chromium and chromium-driver to run it;\n\
         *** set REQUIRE_CHROMIUM=1 to turn this skip into a failure.\n\
         ************************************************************************\n"
    );
}
