//! `make reset-demo` (`deploy/local/demo.sh reset`): it drops the demo's database and the keys
//! under the demo's prefix, and nothing else: not a neighbouring prefix, not another deployment's
//! entry in apalis's global queue list.

use std::path::Path;

use redis::AsyncCommands as _;

use crate::harness::{admin_url, redis_url, TestDb, TestRedis};

const GLOBAL_QUEUES: &str = "core:apalis:queues:list";

#[tokio::test]
async fn reset_demo_drops_the_demo_database_and_prefix_and_leaves_every_other_key_alone() {
    let db = TestDb::new().await;
    // The demo is stopped: nothing holds a connection to its database.
    db.pool.close().await;
    let ours = TestRedis::new().await;
    // A prefix that starts like ours: `ours:*` must not match it.
    let neighbour = TestRedis {
        prefix: format!("{}-x", ours.prefix),
        conn: ours.conn.clone(),
    };
    let mut conn = ours.conn.clone();
    for prefix in [&ours.prefix, &neighbour.prefix] {
        let _: () = conn
            .set(format!("{prefix}:chain:carddata"), "x")
            .await
            .unwrap();
        let _: () = conn
            .hset(format!("{prefix}:q:carddata:data"), "id", "job")
            .await
            .unwrap();
        let _: () = conn
            .zadd(GLOBAL_QUEUES, format!("{prefix}:q:carddata:workers"), 1)
            .await
            .unwrap();
    }

    // Ours: the two above and whatever the harness itself keeps under the prefix.
    let ours_before = ours.keys().await.len();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("bash")
        .arg(root.join("deploy/local/demo.sh"))
        .arg("reset")
        .arg(env!("CARGO_BIN_EXE_cardworker"))
        .arg(root.join("config/local.toml"))
        .env("CARDWORKER__DATABASE__URL", &db.url)
        .env("CARDWORKER__REDIS__URL", redis_url())
        .env("CARDWORKER__REDIS__KEY_PREFIX", &ours.prefix)
        .env_remove("CARDWORKER_CONFIG")
        .output()
        .expect("run demo.sh");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{ours_before} keys deleted")),
        "{ours_before}: {text}"
    );

    let admin = sqlx::PgPool::connect(&admin_url()).await.unwrap();
    let exists: Option<i32> = sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(&db.name)
        .fetch_optional(&admin)
        .await
        .unwrap();
    admin.close().await;
    assert_eq!(exists, None, "the demo database is gone");
    assert!(ours.keys().await.is_empty(), "{:?}", ours.keys().await);
    let mut left = neighbour.keys().await;
    left.sort();
    assert_eq!(
        left,
        [
            format!("{}:chain:carddata", neighbour.prefix),
            format!("{}:q:carddata:data", neighbour.prefix),
        ]
    );
    let queues: Vec<String> = conn.zrange(GLOBAL_QUEUES, 0, -1).await.unwrap();
    assert!(!queues.contains(&format!("{}:q:carddata:workers", ours.prefix)));
    assert!(queues.contains(&format!("{}:q:carddata:workers", neighbour.prefix)));
}
