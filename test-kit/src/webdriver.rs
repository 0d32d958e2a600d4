//! A small WebDriver client (W3C protocol over HTTP, with the reqwest already in the tree) that
//! drives Debian's headless Chromium through its `chromedriver`, for the console's browser test.
//!
//! [`Browser::start`] returns `None` when `chromium` or `chromedriver` is not installed; `make
//! test` and `.ci/run` install both (`deploy/local/browser.sh`) and set
//! `CARDWORKER_REQUIRE_BROWSER`, under which the browser test fails when they are missing (run on
//! its own without it, the test says it is skipped and why). Chromedriver and the browser end, and the profile directory is
//! removed, when the [`Browser`] drops (also when the test fails).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::free_port;

/// The element key of the W3C protocol.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Where Debian's packages put the browser and its driver.
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// Why the browser test cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    for (path, package) in [(CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")] {
        if !Path::new(path).exists() {
            return Some(format!(
                "{path} is missing: install Debian's {package} package \
                 (apt-get install -y chromium chromium-driver, as deploy/local/browser.sh does)"
            ));
        }
    }
    None
}

/// One headless Chromium session.
pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium with a fresh profile; `None` when they are not
    /// installed.
    pub async fn start() -> Option<Browser> {
        if unavailable().is_some() {
            return None;
        }
        let port = free_port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("http client");
        let profile = tempfile::tempdir().expect("profile dir");
        let mut browser = Browser {
            driver,
            base,
            session: String::new(),
            http,
            _profile: profile,
        };
        let started = Instant::now();
        loop {
            let ready = browser
                .http
                .get(format!("{}/status", browser.base))
                .send()
                .await;
            if let Ok(r) = ready {
                let v: Value = r.json().await.unwrap_or_default();
                if v["value"]["ready"] == json!(true) {
                    break;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "chromedriver did not become ready"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1400,1000",
            &format!("--user-data-dir={}", browser._profile.path().display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args},
        }}});
        let v = browser.call("POST", "/session", Some(caps)).await;
        browser.session = v["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {v}"))
            .to_owned();
        Some(browser)
    }

    /// One WebDriver command; panics on a protocol error (use [`Browser::try_call`] to expect one).
    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        match self.try_call(method, path, body).await {
            Ok(v) => v,
            Err(e) => panic!("WebDriver {method} {path}: {e}"),
        }
    }

    /// One WebDriver command: its `value`, or the error it answered.
    pub async fn try_call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, Value> {
        let url = format!("{}{path}", self.base);
        let req = match method {
            "GET" => self.http.get(url),
            "DELETE" => self.http.delete(url),
            _ => self.http.post(url).json(&body.unwrap_or_else(|| json!({}))),
        };
        let resp = req.send().await.expect("chromedriver answers");
        let ok = resp.status().is_success();
        let v: Value = resp.json().await.expect("chromedriver answers JSON");
        if ok {
            Ok(v["value"].clone())
        } else {
            Err(v["value"].clone())
        }
    }

    fn s(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    /// Opens `url` and waits for it to load.
    pub async fn goto(&self, url: &str) {
        self.call("POST", &self.s("/url"), Some(json!({ "url": url })))
            .await;
    }

    /// Runs `script` (a function body) in the page with `args`; its return value.
    pub async fn js(&self, script: &str, args: Value) -> Value {
        self.call(
            "POST",
            &self.s("/execute/sync"),
            Some(json!({"script": script, "args": args})),
        )
        .await
    }

    /// The text of the first element matching `css`, `None` when there is none.
    pub async fn text(&self, css: &str) -> Option<String> {
        let v = self
            .js(
                "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;",
                json!([css]),
            )
            .await;
        v.as_str().map(|s| s.trim().to_owned())
    }

    /// Waits (up to 15 s) until the element `css` exists and its text satisfies `ok`; its text.
    pub async fn wait_text(&self, css: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let t = self.text(css).await;
            if let Some(t) = t.as_deref().filter(|t| ok(t)) {
                return t.to_owned();
            }
            if start.elapsed() > Duration::from_secs(15) {
                let page = self.text("body").await.unwrap_or_default();
                panic!(
                    "timed out waiting for {what} ({css}); it is {t:?}; the page reads:\n{page}"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits up to 15 s until the first element matching `css` reads `want`
    /// ([`Browser::wait_text`]).
    pub async fn wait_text_is(&self, css: &str, want: &str) -> String {
        let what = format!("{want:?}");
        self.wait_text(css, &what, |t| t == want).await
    }

    /// The first element matching `css`.
    pub async fn find(&self, css: &str) -> String {
        let v = self
            .call(
                "POST",
                &self.s("/element"),
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element id for {css}: {v}"))
            .to_owned()
    }

    /// Clicks the element `css` (as a user would).
    pub async fn click(&self, css: &str) {
        let id = self.find(css).await;
        self.call("POST", &self.s(&format!("/element/{id}/click")), None)
            .await;
    }

    /// Types `text` into the element `css`.
    pub async fn type_into(&self, css: &str, text: &str) {
        let id = self.find(css).await;
        self.call(
            "POST",
            &self.s(&format!("/element/{id}/value")),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// The text of an open `alert()`, if one is open.
    /// `None` only when WebDriver says that no alert is open; any other error fails the test.
    pub async fn alert_text(&self) -> Option<String> {
        match self.try_call("GET", &self.s("/alert/text"), None).await {
            Ok(v) => Some(
                v.as_str()
                    .unwrap_or_else(|| panic!("an alert's text is a string: {v}"))
                    .to_owned(),
            ),
            Err(e) if e["error"] == "no such alert" => None,
            Err(e) => panic!("reading the alert failed: {e}"),
        }
    }

    /// The current URL.
    pub async fn url(&self) -> String {
        self.call("GET", &self.s("/url"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// A PNG screenshot of the window, written to `path`; returns its size in bytes.
    pub async fn screenshot(&self, path: &Path) -> usize {
        use base64::Engine as _;
        let v = self.call("GET", &self.s("/screenshot"), None).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().expect("base64 screenshot"))
            .expect("decodes");
        assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
        std::fs::write(path, &png).expect("write screenshot");
        png.len()
    }

    /// Where screenshots go: `docs/console/` when `CARDWORKER_CONSOLE_SCREENSHOTS=1`
    /// (`make console-screenshots`), else a temporary directory.
    pub fn screenshot_dir(tmp: &tempfile::TempDir) -> PathBuf {
        if std::env::var("CARDWORKER_CONSOLE_SCREENSHOTS").as_deref() == Ok("1") {
            let dir = crate::repo_root().join("docs/console");
            std::fs::create_dir_all(&dir).expect("docs/console");
            dir
        } else {
            tmp.path().to_path_buf()
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session closes Chromium; then the driver goes. From a thread of its own
        // with its own runtime: the test's runtime is blocked in this drop.
        if !self.session.is_empty() {
            let url = format!("{}/session/{}", self.base, self.session);
            let _ = std::thread::spawn(move || {
                if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    rt.block_on(async {
                        let client = reqwest::Client::new();
                        let _ = tokio::time::timeout(
                            Duration::from_secs(10),
                            client.delete(&url).send(),
                        )
                        .await;
                    });
                }
            })
            .join();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
