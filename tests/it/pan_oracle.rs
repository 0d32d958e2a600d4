//! The independent oracle of spec section 10: test card numbers written, in every separator form,
//! into every free-text input the product accepts (Gateway reasons and bodies, callback bodies,
//! CLI arguments, a config value that is reported), then searched for as bare digits in every
//! place the product writes: a `pg_dump` of the database, every Redis key and value under the
//! prefix, the worker's log, the CLI's output, `investigate` and the console's pages. The search
//! never uses the masker: it takes everything but the ASCII digits out of each line and looks for
//! each number's digits. And with numeric identifiers that look like card numbers, the same
//! search over the dump finds every identifier stored exactly.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use redis::AsyncCommands as _;
use serde_json::json;

use crate::console::ConsoleProcess;
use crate::harness::{
    assert_success, spawn_app, spawn_worker, wait_until, worker_config_file, TestDb, TestRedis,
};
use crate::identifiers::status_callback;

/// Test card numbers of the card schemes: the oracle's fixed list.
const TEST_PANS: [&str; 8] = [
    "4111111111111111",
    "4012888888881881",
    "5555555555554444",
    "5105105105105100",
    "378282246310005",
    "6011111111111117",
    "3530111333300000",
    "4222222222222",
];

/// How the oracle writes a card number: this separator every so many digits.
const FORMS: [(&str, usize); 16] = [
    ("", 1),
    (" ", 4),
    ("-", 4),
    (".", 4),
    ("/", 4),
    ("_", 4),
    (",", 4),
    ("\t", 4),
    ("\n", 4),
    ("\r\n", 4),
    (" \t ", 3),
    ("     ", 4),
    (" - ", 2),
    ("\u{A0}", 4),
    ("\u{3000}", 4),
    ("__,,", 1),
];

/// Cards of the run: each answers with its own number in its own form.
const CARDS: usize = 32;

/// The `n`-th written card number: every form with every number, none twice in 128.
fn written(n: usize) -> String {
    let pan = TEST_PANS[(n / 4) % TEST_PANS.len()];
    let (sep, every) = FORMS[n % FORMS.len()];
    let mut s = String::new();
    for (i, c) in pan.chars().enumerate() {
        if i > 0 && i % every == 0 {
            s.push_str(sep);
        }
        s.push(c);
    }
    s
}

/// The card number of the index in a `c-pan-N` card_ref.
fn card_index(card_ref: &str) -> usize {
    card_ref
        .rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A Gateway that puts a card number in every answer: a 503 reason, a 200 whose values are
/// outside the contract, a 200 that is not JSON, a 422 whose JSON carries it twice; and a payment
/// refused with one (a 422), never seen by a query (404).
async fn card_answer(Path((card_ref, _what)): Path<(String, String)>) -> Response {
    let n = card_index(&card_ref);
    let pan = written(n);
    match n % 4 {
        0 => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("card {pan} declined at the issuer"),
        )
            .into_response(),
        1 => axum::Json(json!({"card_ref": card_ref, "state": pan, "status": pan})).into_response(),
        2 => (StatusCode::OK, format!("not json: {pan}")).into_response(),
        _ => (
            StatusCode::UNPROCESSABLE_ENTITY,
            axum::Json(json!({"error": format!("card {pan} refused"), "pan": pan})),
        )
            .into_response(),
    }
}

async fn spawn_pan_gateway() -> (String, tokio::task::JoinHandle<()>) {
    let router = Router::new()
        .route("/v1/cards/{card_ref}/{what}", get(card_answer))
        .route(
            "/v1/payments",
            axum::routing::post(|| async {
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!("card {} refused for payment", written(100)),
                )
            }),
        )
        .route("/v1/payments/{id}", get(|| async { StatusCode::NOT_FOUND }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the Gateway");
    let addr = listener.local_addr().expect("address");
    let serve = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    (format!("http://{addr}"), serve)
}

/// `cardworker ARGS --config CONFIG` with `env`: its exit status and everything it printed.
fn cli(config: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(args)
        .arg("--config")
        .arg(config)
        .envs(env.iter().copied())
        .env("CARDWORKER_OPERATOR", "oracle")
        .output()
        .expect("run the CLI");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// Every key under the prefix and its value, one line per key, field or member.
async fn redis_text(redis: &TestRedis) -> String {
    let mut conn = redis.conn.clone();
    let mut text = String::new();
    for key in redis.keys().await {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("type");
        let values: Vec<String> = match kind.as_str() {
            "string" => vec![conn.get(&key).await.unwrap_or_default()],
            "hash" => conn
                .hgetall::<_, Vec<String>>(&key)
                .await
                .unwrap_or_default(),
            "list" => conn.lrange(&key, 0, -1).await.unwrap_or_default(),
            "set" => conn.smembers(&key).await.unwrap_or_default(),
            "zset" => conn.zrange(&key, 0, -1).await.unwrap_or_default(),
            "stream" => {
                let v: redis::Value = redis::cmd("XRANGE")
                    .arg(&key)
                    .arg("-")
                    .arg("+")
                    .query_async(&mut conn)
                    .await
                    .expect("xrange");
                vec![format!("{v:?}")]
            }
            other => vec![format!("(type {other})")],
        };
        text.push_str(&key);
        text.push('\n');
        for v in values {
            text.push_str(&v);
            text.push('\n');
        }
    }
    text
}

/// `pg_dump --data-only` of the database at `url`.
fn pg_dump(url: &str) -> String {
    let out = Command::new("pg_dump")
        .args(["--data-only", "--no-owner", "--dbname", url])
        .output()
        .expect("pg_dump");
    assert_success(&out, "pg_dump");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The oracle's search: each (place, line) whose digits, with everything else taken out, hold a
/// test card number.
fn findings(places: &[(String, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for (place, text) in places {
        for line in text.lines() {
            let digits: String = line.chars().filter(char::is_ascii_digit).collect();
            for pan in TEST_PANS {
                if digits.contains(pan) {
                    found.push(format!("{place}: {pan} in {line:?}"));
                }
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oracle_no_test_card_number_written_into_free_text_is_found_anywhere_the_product_writes() {
    let db = TestDb::new().await;
    let redis = TestRedis::new().await;
    let (gateway, _serve) = spawn_pan_gateway().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = worker_config_file(
        &dir,
        (&db, 5),
        &redis,
        &gateway,
        "timeout_ms = 2000\n\n[polling]\nhandler_timeout_secs = 4\nlease_ttl_secs = 10\n\n\
         [polling.carddata]\ninterval_secs = 1\n\n[polling.card_status]\ninterval_secs = 1\n\n\
         [polling.circuit]\nenabled = false\n",
    );
    for n in 0..CARDS {
        sqlx::query("INSERT INTO cards (card_ref) VALUES ($1)")
            .bind(format!("c-pan-{n}"))
            .execute(&db.pool)
            .await
            .expect("card");
    }
    let payment = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO payments (payment_id, card_ref, amount_minor, currency) VALUES ($1, 'c-pan-0', 1234, 'CNY')",
    )
    .bind(payment)
    .execute(&db.pool)
    .await
    .expect("payment");
    let worker = spawn_worker(&config);
    let worker_log = Arc::clone(&worker.log);
    let mut outputs: Vec<(String, String)> = Vec::new();
    let mut run = |args: &[&str], env: &[(&str, &str)]| {
        let (code, text) = cli(&config, args, env);
        outputs.push((format!("cardworker {} (exit {code})", args.join(" ")), text));
        code
    };
    assert_eq!(run(&["reconcile"], &[]), 0, "{:?}", outputs.last());
    // Every card polled for both tasks at least once, each answer carrying its number.
    wait_until(
        Duration::from_secs(90),
        "every card's polls are recorded",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(DISTINCT (resource_id, scenario)) FROM integration_logs
                  WHERE scenario IN ('carddata_poll', 'card_status_poll')",
            )
            .fetch_one(&db.pool)
            .await
            .expect("count")
                >= 2 * CARDS as i64
        },
    )
    .await;

    // Operator actions whose reasons carry a number.
    let reasons: Vec<String> = (0..4).map(|n| written(40 + n)).collect();
    let task_args = |verb: &'static str, reason: &str| -> Vec<String> {
        vec![
            "budget".into(),
            verb.into(),
            "--task".into(),
            "carddata".into(),
            "--reason".into(),
            reason.into(),
        ]
    };
    for (verb, reason) in [("pause", &reasons[0]), ("resume", &reasons[1])] {
        let args = task_args(verb, reason);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_eq!(run(&args, &[]), 0, "{:?}", outputs.last());
    }
    assert_eq!(
        run(
            &[
                "enqueue",
                "carddata",
                "--card-ref",
                "c-pan-2",
                "--reason",
                &reasons[2]
            ],
            &[]
        ),
        0,
        "{:?}",
        outputs.last()
    );
    // A payment the Gateway refuses, quoting a number (a 4xx: recorded, and retried later with
    // the same key).
    let payment_arg = payment.to_string();
    assert_eq!(
        run(&["enqueue", "payment", "--payment-id", &payment_arg], &[]),
        0,
        "{:?}",
        outputs.last()
    );
    wait_until(
        Duration::from_secs(60),
        "the payment's refusal is recorded",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM integration_logs
                  WHERE resource_type = 'payment' AND state <> 'pending'",
            )
            .fetch_one(&db.pool)
            .await
            .expect("count")
                >= 1
        },
    )
    .await;
    // The callbacks are queued while no worker runs, so that their jobs' payloads are in Redis
    // when it is searched.
    drop(worker);
    // Callbacks whose free fields carry numbers: a status outside the contract, an extra field,
    // a body that is not JSON, a payment result with a number for its status.
    let bodies = [
        json!({"type": "card.status", "card_ref": "c-pan-0", "status": written(50), "note": written(51)}).to_string(),
        json!({"type": "card.status", "card_ref": "c-pan-1", "status": "frozen", "cardholder": written(52)}).to_string(),
        format!("pan {}", written(53)),
        json!({"type": "payment.result", "payment_id": payment, "status": written(54), "channel_ref": "ch-1"}).to_string(),
    ];
    for (i, body) in bodies.iter().enumerate() {
        let file = dir.path().join(format!("callback-{i}.json"));
        std::fs::write(&file, body).expect("body file");
        let id = format!("cb-{i}");
        let file = file.to_string_lossy().into_owned();
        assert_eq!(
            run(
                &[
                    "enqueue",
                    "callback",
                    "--channel",
                    "visa",
                    "--callback-id",
                    &id,
                    "--body-file",
                    &file
                ],
                &[]
            ),
            0,
            "{:?}",
            outputs.last()
        );
    }
    // A config value that is reported back: refused with exit 2, naming the value given.
    let bad_limit = written(60);
    assert_eq!(
        run(
            &["check-config"],
            &[("CARDWORKER__POLLING__TOTAL_LIMIT", &bad_limit)]
        ),
        2,
        "{:?}",
        outputs.last()
    );
    let mut places = vec![(
        "redis (callbacks queued)".to_owned(),
        redis_text(&redis).await,
    )];
    let worker = spawn_worker(&config);
    let second_log = Arc::clone(&worker.log);
    wait_until(
        Duration::from_secs(60),
        "the callbacks are handled",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM inbound_callbacks WHERE state IN ('applied', 'failed')",
            )
            .fetch_one(&db.pool)
            .await
            .expect("count")
                == bodies.len() as i64
        },
    )
    .await;
    for n in 0..4 {
        let card = format!("c-pan-{n}");
        run(&["investigate", "--card-ref", &card], &[]);
        run(
            &["investigate", "--card-ref", &card, "--format", "json"],
            &[],
        );
    }
    let console = ConsoleProcess::start_on(&db.url, &redis.prefix, None).await;
    for path in [
        "/",
        "/queues",
        "/parked",
        "/money",
        "/cards/c-pan-0",
        "/cards/c-pan-1",
        "/cards/c-pan-3",
    ] {
        let resp = reqwest::get(format!("{}{path}", console.url))
            .await
            .expect("console answers");
        let status = resp.status().as_u16();
        let page = resp.text().await.unwrap_or_default();
        assert_eq!(status, 200, "{path}: {page}");
        outputs.push((format!("console {path}"), page));
    }
    places.extend(outputs);
    places.push((
        "redis (worker running)".to_owned(),
        redis_text(&redis).await,
    ));
    drop(worker);
    places.push(("redis".to_owned(), redis_text(&redis).await));
    places.push(("pg_dump".to_owned(), pg_dump(&db.url)));
    for log in [worker_log, second_log] {
        places.push(("worker log".to_owned(), log.lock().expect("log").join("\n")));
    }
    let found = findings(&places);
    assert!(
        found.is_empty(),
        "{} card numbers found:\n{}",
        found.len(),
        found.join("\n")
    );
    // The inputs did reach the places searched: the masks are there.
    let masks = |place: &str| {
        places
            .iter()
            .filter(|(p, _)| p.starts_with(place))
            .map(|(_, text)| text.matches("[redacted]").count())
            .sum::<usize>()
    };
    for (place, at_least) in [
        ("pg_dump", CARDS),
        ("worker log", 1),
        ("redis (callbacks queued)", 2),
        ("cardworker investigate", 1),
        ("cardworker check-config", 1),
        ("console /cards/", 1),
    ] {
        assert!(masks(place) >= at_least, "{place}: {} masks", masks(place));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oracle_numeric_identifiers_that_look_like_card_numbers_are_found_stored_exactly() {
    let app = spawn_app().await;
    let card = TEST_PANS[0];
    app.insert_card(card).await;
    // A card keyed by a number, a callback id, a channel and a channel_ref that are numbers.
    let job = status_callback(TEST_PANS[1], TEST_PANS[2], card, "frozen");
    cardworker::payments::callback::process(&app.ctx, &job)
        .await
        .expect("delivery");
    let payment = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO payments (payment_id, card_ref, amount_minor, currency) VALUES ($1, $2, 100, 'CNY')",
    )
    .bind(payment)
    .bind(card)
    .execute(&app.db.pool)
    .await
    .expect("payment");
    let result = cardworker_jobs::ProcessCallback {
        channel: TEST_PANS[1].to_owned(),
        callback_id: TEST_PANS[3].to_owned(),
        body: json!({"type": "payment.result", "payment_id": payment, "status": "accepted", "channel_ref": TEST_PANS[4]})
            .to_string(),
        retries: 0,
        recorded: false,
    };
    cardworker::payments::callback::process(&app.ctx, &result)
        .await
        .expect("delivery");
    let dump = pg_dump(&app.db.url);
    // Each identifier is a whole field of the rows that key on it (COPY's tab-separated text).
    let field = |id: &str| {
        dump.lines()
            .filter(|l| l.split('\t').any(|f| f == id))
            .count()
    };
    for (id, at_least, what) in [
        (
            card,
            4,
            "the card, the callback's resource, the audit link, the outbox aggregate",
        ),
        (TEST_PANS[1], 2, "the channel of both callbacks"),
        (TEST_PANS[2], 1, "the status callback's id"),
        (TEST_PANS[3], 1, "the payment callback's id"),
        (TEST_PANS[4], 1, "the payment's channel_ref"),
    ] {
        assert!(
            field(id) >= at_least,
            "{id} ({what}) found {} times in:\n{dump}",
            field(id)
        );
    }
    let (status, channel_ref): (String, Option<String>) =
        sqlx::query_as("SELECT status, channel_ref FROM payments WHERE payment_id = $1")
            .bind(payment)
            .fetch_one(&app.db.pool)
            .await
            .expect("payment");
    assert_eq!(
        (status.as_str(), channel_ref.as_deref()),
        ("accepted", Some(TEST_PANS[4]))
    );
    // Free text that quotes an identifier (a summary) masks it; no identifier field is masked.
    assert!(
        !dump
            .lines()
            .any(|l| l.split('\t').any(|f| f == "[redacted]")),
        "no identifier was masked:\n{dump}"
    );
}
