//! The operator's console used as a person uses it, in a headless Chromium: a real failure
//! leaves an operation in doubt, the operator finds it in the list, opens it, resolves it,
//! and the caller's next run takes effect once.
//!
//! Needs `chromium` and `chromedriver` (Debian's `chromium` and `chromium-driver`); without
//! them the tests say so loudly and pass, with `REQUIRE_CHROMIUM=1` (as `.ci/run` sets) they
//! fail. Screenshots of the list and of the record go to `console-screenshots/` in the
//! target directory; with `BLESS_CONSOLE_SCREENSHOT=1` the list's also replaces
//! `docs/console-list.png`.

#[path = "console_browser/webdriver.rs"]
mod webdriver;

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::client::ClientFace;
use tower_idempotency::console::{Console, Operator, Refusal, Role};
use tower_idempotency::idempotency::{record_or_not_found, LookupReconciler};
use tower_idempotency::ledger::{Expected, LedgerKey, MemoryStore, Records};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, SideEffectService, LOOKUP_PATH};
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, OperationId};

use webdriver::Browser;

/// Where the console is nested in the user's router.
const PREFIX: &str = "/_idempotency";

/// The caller's operation the scenario leaves in doubt.
fn the_charge() -> OperationId {
    OperationId::new("task-7", "charge_customer")
}

/// The request the caller's step sends for `operation`.
fn charge(operation: OperationId) -> Request<Full<Bytes>> {
    let mut request = Request::post("http://payments.local/charges")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"order_id":"order_42","amount_cents":1999}"#,
        )))
        .unwrap();
    request.extensions_mut().insert(operation);
    request
}

/// A caller whose provider does not deduplicate, so an operation in doubt waits for an
/// operator instead of being sent again on its own.
struct Caller {
    layer: IdempotencyLayer<ClientFace>,
    policy: RetryPolicy,
    provider: SideEffectService,
}

impl Caller {
    /// The real scenario: the provider answers the first charge 503 without charging (the
    /// attempt never took effect, so none ran), the caller cannot tell and leaves the
    /// operation in doubt, and its next run is refused as unreconciled. Another operation,
    /// charged by another provider, completes beside it, so the list has something to
    /// filter out.
    async fn left_in_doubt() -> Caller {
        Self::left_in_doubt_having_charged(false).await
    }

    /// [`left_in_doubt`](Self::left_in_doubt), the provider having `charged` before its 503
    /// or not: either way the caller cannot tell.
    async fn left_in_doubt_having_charged(charged: bool) -> Caller {
        let provider = SideEffectService::new().with_faults([Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: charged,
        }]);
        let policy = RetryPolicy::builder().max_attempts(1).build().unwrap();
        let layer = IdempotencyLayer::client_builder(Arc::new(MemoryStore::new()))
            .provider_deduplicates(false)
            .retry_policy(policy.clone())
            .build()
            .unwrap();
        let caller = Caller {
            layer,
            policy,
            provider,
        };

        let unavailable = caller.run(&caller.provider, the_charge()).await.unwrap();
        assert_eq!(unavailable, StatusCode::SERVICE_UNAVAILABLE);
        let err = caller
            .run(&caller.provider, the_charge())
            .await
            .unwrap_err();
        assert!(err.is_unreconciled(), "not sent again on its own: {err}");
        assert_eq!(
            caller.provider.effects(),
            usize::from(charged),
            "the 503 charged only if the provider committed first"
        );

        let neighbour = OperationId::new("task-8", "charge_customer");
        let elsewhere = SideEffectService::new();
        assert_eq!(
            caller.run(&elsewhere, neighbour).await.unwrap(),
            StatusCode::CREATED
        );
        caller
    }

    /// The caller's step: `operation` through the caller's layers to `provider`.
    async fn run(
        &self,
        provider: &SideEffectService,
        operation: OperationId,
    ) -> Result<StatusCode, tower_idempotency::Error> {
        ServiceBuilder::new()
            .layer(self.layer.clone())
            .layer(FrozenRetryLayer::new(self.policy.clone()))
            .service(provider.clone())
            .oneshot(charge(operation))
            .await
            .map(|response| response.status())
    }

    /// The body the caller's step gets for `operation` (a replay: no provider is reached,
    /// the one given has no effect left to make).
    async fn replayed_body(&self, operation: OperationId) -> Bytes {
        let response = ServiceBuilder::new()
            .layer(self.layer.clone())
            .layer(FrozenRetryLayer::new(self.policy.clone()))
            .service(self.provider.clone())
            .oneshot(charge(operation))
            .await
            .unwrap();
        http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes()
    }

    fn records(&self) -> Records {
        self.layer.records()
    }

    fn key_of_the_charge(&self) -> LedgerKey {
        self.records().operation_key(&the_charge())
    }
}

/// Operators sign in to the user's app, which keeps who they are in a session cookie; the
/// test's session is `operator=NAME`, and every operator may act.
fn cookie_authorizer(head: &http::request::Parts) -> Result<Operator, Refusal> {
    let operator = head
        .headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|cookies| cookies.split(';'))
        .find_map(|cookie| cookie.trim().strip_prefix("operator="))
        .ok_or_else(|| Refusal::unauthenticated("sign in: no session cookie"))?;
    Ok(Operator::new(operator, Role::Act))
}

/// The console over `records`, nested under [`PREFIX`] in a user's router beside their own
/// route, served on loopback; its base address.
async fn serve(records: Records) -> String {
    serve_console(Console::new(records, cookie_authorizer)).await
}

/// [`serve`], for a console built already (with [`cookie_authorizer`]).
async fn serve_console(console: Console) -> String {
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .nest(PREFIX, console.router());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// Where screenshots go: `console-screenshots/` in the target directory.
fn screenshots() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the test's scratch directory is in the target directory")
        .join("console-screenshots")
}

/// Sign `operator` in on the app at `base`: the cookie is set on the app's origin.
async fn sign_in(browser: &Browser, base: &str, operator: &str) {
    browser.go(&format!("{base}/health")).await;
    browser.add_cookie("operator", operator).await;
}

/// Open the list, filter it to operations in doubt, and open `key`'s record from it, as an
/// operator does; the list is saved as `list.png`.
async fn open_in_doubt_record(browser: &Browser, base: &str, key: &LedgerKey, shots: &str) {
    browser.go(&format!("{base}{PREFIX}")).await;
    browser.wait_for_text("h1", "Records").await;
    browser.wait_for_text("table", "completed (201)").await;
    browser
        .click(
            &browser
                .find("select[name=state] option[value=in_doubt]")
                .await,
        )
        .await;
    browser
        .click(&browser.find("form button[type=submit]").await)
        .await;
    browser.wait_for_url("state=in_doubt").await;
    let table = browser.wait_for_text("table", "in doubt").await;
    assert!(
        !table.contains("completed"),
        "the filter leaves the completed operation out: {table}"
    );
    let key = key.to_hex();
    let link = browser.find(&format!("a[href$='/records/{key}']")).await;
    browser
        .screenshot(&screenshots().join(format!("{shots}-list.png")))
        .await;
    browser.click(&link).await;
    browser
        .wait_for_url(&format!("{PREFIX}/records/{key}"))
        .await;
    browser.wait_for_text("h1", "Record").await;
    let fields = browser.wait_for_text("table", &key).await;
    assert!(fields.contains("in doubt"), "{fields}");
}

/// Fill in the record page's `action` form (its path: `resolve-not-applied`, `forget`,
/// `resolve-applied`), typing each of `fields` (field name, text) into its input or text
/// area, and submit it; the record page is saved, filled in, as `record.png`.
async fn submit_action(browser: &Browser, action: &str, fields: &[(&str, &str)], shots: &str) {
    // Tall enough for the whole record and its forms: the screenshot shows what was acted on.
    browser.resize(1000, 1000).await;
    let form = format!("form[action$='/{action}']");
    for (name, text) in fields {
        let field = browser.find(&format!("{form} [name={name}]")).await;
        browser.type_into(&field, text).await;
    }
    browser
        .screenshot(&screenshots().join(format!("{shots}-record.png")))
        .await;
    browser
        .click(&browser.find(&format!("{form} button[type=submit]")).await)
        .await;
}

/// Say where the screenshots are, past the harness's capture of a passing test's output.
fn tell_where_screenshots_are() {
    let _ = writeln!(
        std::io::stderr(),
        "console screenshots (the list and the record): {}",
        screenshots().display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolves_an_operation_in_doubt_as_not_applied_in_a_browser_and_it_takes_effect_once(
) {
    let Some(browser) = Browser::launch().await else {
        return;
    };
    let caller = Caller::left_in_doubt().await;
    let key = caller.key_of_the_charge();
    let base = serve(caller.records()).await;

    sign_in(&browser, &base, "alice").await;
    open_in_doubt_record(&browser, &base, &key, "not-applied").await;
    submit_action(
        &browser,
        "resolve-not-applied",
        &[("reason", "INC-42: the provider has no charge for order_42")],
        "not-applied",
    )
    .await;
    browser
        .wait_for_text(".flash", "Resolved as not applied")
        .await;
    browser
        .wait_for_url(&format!("{PREFIX}?flash=resolved"))
        .await;
    assert_eq!(caller.records().inspect(key).await.unwrap(), None);

    // The caller's step, run again: it charges now, and once.
    let charged = caller.run(&caller.provider, the_charge()).await.unwrap();
    assert_eq!(charged, StatusCode::CREATED);
    let replayed = caller.run(&caller.provider, the_charge()).await.unwrap();
    assert_eq!(replayed, StatusCode::CREATED);
    assert_eq!(caller.provider.effects(), 1, "one charge in all");

    tell_where_screenshots_are();
    if std::env::var("BLESS_CONSOLE_SCREENSHOT").is_ok_and(|value| value == "1") {
        let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/console-list.png");
        std::fs::copy(screenshots().join("not-applied-list.png"), &docs).unwrap();
        eprintln!("the list's screenshot replaced {}", docs.display());
    }
}

/// The other way out, as a person takes it: the failed attempt did charge, the operator
/// finds the charge on the provider's dashboard, opens the record in doubt and resolves it
/// as applied with the provider's status and receipt, and sees it completed; the caller's
/// next run replays the receipt and charges nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolves_an_operation_in_doubt_as_applied_in_a_browser_and_it_is_never_charged_again(
) {
    let Some(browser) = Browser::launch().await else {
        return;
    };
    let caller = Caller::left_in_doubt_having_charged(true).await;
    let key = caller.key_of_the_charge();
    let base = serve(caller.records()).await;

    sign_in(&browser, &base, "alice").await;
    open_in_doubt_record(&browser, &base, &key, "applied").await;
    let receipt = r#"{"id":"ch_1","amount_cents":1999,"status":"succeeded"}"#;
    submit_action(
        &browser,
        "resolve-applied",
        &[
            (
                "reason",
                "INC-51: the dashboard shows charge ch_1 for order_42",
            ),
            ("status", "201"),
            ("body", receipt),
        ],
        "applied",
    )
    .await;
    browser.wait_for_text(".flash", "Resolved as applied").await;
    browser
        .wait_for_url(&format!("{PREFIX}/records/{}?flash=applied", key.to_hex()))
        .await;
    browser.wait_for_text("table", "completed (201)").await;
    browser
        .screenshot(&screenshots().join("applied-completed.png"))
        .await;

    // The caller's step, run again: the receipt is replayed, and nothing charged.
    for _ in 0..2 {
        let replayed = caller.run(&caller.provider, the_charge()).await.unwrap();
        assert_eq!(replayed, StatusCode::CREATED);
    }
    assert_eq!(
        caller.provider.effects(),
        1,
        "the one charge, before the doubt"
    );
    let body = caller.replayed_body(the_charge()).await;
    assert_eq!(
        body,
        receipt.as_bytes(),
        "the operator's receipt, byte for byte"
    );
}

/// Two operators on one incident: a colleague resolves the operation first and the caller's
/// next run charges; the form on the operator's page still carries the look it was opened
/// with, so submitting it changes nothing and shows the record as it is now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolution_from_a_page_gone_stale_changes_nothing_and_shows_the_record_as_it_is_now() {
    let Some(browser) = Browser::launch().await else {
        return;
    };
    let caller = Caller::left_in_doubt().await;
    let key = caller.key_of_the_charge();
    let base = serve(caller.records()).await;

    sign_in(&browser, &base, "alice").await;
    open_in_doubt_record(&browser, &base, &key, "stale").await;

    let records = caller.records();
    let look = records.inspect(key).await.unwrap().expect("in doubt");
    let forgotten = records.forget(key, Expected::of(&look)).await.unwrap();
    assert!(forgotten.is_forgotten(), "{forgotten:?}");
    let charged = caller.run(&caller.provider, the_charge()).await.unwrap();
    assert_eq!(charged, StatusCode::CREATED);

    submit_action(
        &browser,
        "resolve-not-applied",
        &[("reason", "INC-42: no charge at the provider")],
        "stale",
    )
    .await;
    browser.wait_for_text("h1", "Conflict").await;
    browser
        .wait_for_text(".problem", "moved on since you looked at it")
        .await;
    browser.wait_for_text("table", "completed (201)").await;
    browser.find("form[action$='/forget']").await;
    browser
        .screenshot(&screenshots().join("stale-conflict.png"))
        .await;

    let replayed = caller.run(&caller.provider, the_charge()).await.unwrap();
    assert_eq!(replayed, StatusCode::CREATED, "replayed, not run again");
    assert_eq!(caller.provider.effects(), 1, "one charge in all");
}

/// An operator reads a long list a page at a time with its own form and link: a page size
/// of one, then "Next page", which keeps the filters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_pages_through_the_list_with_its_next_link() {
    let Some(browser) = Browser::launch().await else {
        return;
    };
    let caller = Caller::left_in_doubt().await;
    let base = serve(caller.records()).await;

    sign_in(&browser, &base, "alice").await;
    browser.go(&format!("{base}{PREFIX}")).await;
    browser.wait_for_text("h1", "Records").await;
    browser
        .click(
            &browser
                .find("select[name=order] option[value=oldest]")
                .await,
        )
        .await;
    browser
        .type_into(&browser.find("input[name=limit]").await, "1")
        .await;
    browser
        .click(&browser.find("form button[type=submit]").await)
        .await;
    browser.wait_for_url("limit=1").await;
    let first = browser.wait_for_text("table", "Key").await;

    browser
        .click(&browser.find("a[href*='after=']").await)
        .await;
    let second_url = browser.wait_for_url("after=").await;
    assert!(
        second_url.contains("order=oldest") && second_url.contains("limit=1"),
        "the next page keeps the filters: {second_url}"
    );
    let second = browser.wait_for_text("table", "Key").await;

    let pages = [&first, &second];
    let shows = |state: &str| pages.iter().filter(|page| page.contains(state)).count();
    assert_eq!(shows("in doubt"), 1, "{first}\n---\n{second}");
    assert_eq!(shows("completed (201)"), 1, "{first}\n---\n{second}");
}

/// Reconcile now, as a person does it: the failed attempt did charge, and the operator,
/// rather than search the provider's dashboard, opens the record in doubt (its request
/// shown with the field the console redacts hidden) and asks the layer's reconciler, which
/// finds the charge. The record is completed with the provider's record, and the caller's
/// next run replays it and charges nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_reconciles_an_operation_in_doubt_now_in_a_browser_and_it_is_never_charged_again(
) {
    let Some(browser) = Browser::launch().await else {
        return;
    };
    let caller = Caller::left_in_doubt_having_charged(true).await;
    let key = caller.key_of_the_charge();
    // The operators' console over a client layer of the same ledger, with a reconciler.
    let reconciler = LookupReconciler::by_key(
        caller.provider.clone(),
        LOOKUP_PATH,
        "idempotency_key",
        record_or_not_found,
    )
    .applied_status(StatusCode::CREATED);
    let operators = IdempotencyLayer::client_builder(caller.records().store().clone())
        .provider_deduplicates(false)
        .reconcile(reconciler)
        .build()
        .unwrap();
    let base = serve_console(
        Console::new(operators.records(), cookie_authorizer).redact_fields(["/order_id"]),
    )
    .await;

    sign_in(&browser, &base, "alice").await;
    open_in_doubt_record(&browser, &base, &key, "reconcile-now").await;
    let body = browser.wait_for_text("pre", "[redacted]").await;
    assert!(
        !body.contains("order_42") && body.contains("1999"),
        "the named field redacted, the rest shown: {body}"
    );
    submit_action(
        &browser,
        "reconcile-now",
        &[(
            "reason",
            "INC-60: ask the provider whether order_42 was charged",
        )],
        "reconcile-now",
    )
    .await;
    browser
        .wait_for_text(".flash", "The reconciler found the operation applied")
        .await;
    browser
        .wait_for_url(&format!(
            "{PREFIX}/records/{}?flash=reconciled-applied",
            key.to_hex()
        ))
        .await;
    browser.wait_for_text("table", "completed (201)").await;

    // The caller's step, run again: the provider's record is replayed, and nothing charged.
    for _ in 0..2 {
        let replayed = caller.run(&caller.provider, the_charge()).await.unwrap();
        assert_eq!(replayed, StatusCode::CREATED);
    }
    assert_eq!(
        caller.provider.effects(),
        1,
        "the one charge, before the doubt"
    );
}
