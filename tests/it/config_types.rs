//! The configuration's types: defaults, the task names, TOML rendering and the redaction of
//! secrets.

use cardworker::config::{Config, LogFormat, Task};

use cardworker::limit::{Limit, LimitError, LIMIT_CEILING};

use cardworker::secret::SecretUrl;

use crate::config_support::from_str;

#[test]
fn defaults_are_valid_and_match_the_spec() {
    let c = Config::default();
    c.validate().expect("defaults are valid");
    assert_eq!(c.polling.total_limit, 8);
    assert_eq!(c.polling.carddata.interval_secs, 30);
    assert_eq!(c.polling.card_status.interval_secs, 300);
    assert_eq!(c.polling.task(Task::CardStatus).limit, 4);
    assert_eq!(c.telemetry.log_format, LogFormat::Json);
    assert!(c.polling.total_limit <= LIMIT_CEILING);
    assert_eq!(Config::load_from(None, vec![]).expect("loads"), c);
}

#[test]
fn rendered_toml_loads_back_to_the_same_config() {
    let mut c = Config::default();
    c.polling.carddata.limit = Limit::new(2).expect("a limit");
    let text = c.to_toml_string().expect("renders");
    assert_eq!(from_str(&text).expect("valid"), c);
}

#[test]
fn task_names_parse_and_label() {
    assert_eq!("carddata".parse::<Task>(), Ok(Task::Carddata));
    assert_eq!("card-status".parse::<Task>(), Ok(Task::CardStatus));
    assert_eq!("card_status".parse::<Task>(), Ok(Task::CardStatus));
    assert!("cardStatus".parse::<Task>().is_err());
    let labels: Vec<&str> = Task::ALL.iter().map(|t| t.label()).collect();
    assert_eq!(labels, ["carddata", "card_status"]);
    assert_eq!(Task::CardStatus.to_string(), "card_status");
}

#[test]
fn clap_parses_every_cli_spelling_of_a_task() {
    use clap::ValueEnum as _;
    for (raw, want) in [
        ("carddata", Task::Carddata),
        ("card-status", Task::CardStatus),
        ("card_status", Task::CardStatus),
    ] {
        assert_eq!(
            <Task as clap::ValueEnum>::from_str(raw, false),
            Ok(want),
            "{raw}"
        );
    }
    assert!(<Task as clap::ValueEnum>::from_str("cardStatus", false).is_err());
    assert!(<Task as clap::ValueEnum>::from_str("all", false).is_err());
    // clap lists the same tasks, in the same order, as `Task::ALL`.
    assert_eq!(Task::value_variants(), Task::ALL);
}

#[test]
fn clap_shows_the_one_spelling_of_config_and_metrics_and_accepts_card_status_with_a_hyphen() {
    use clap::ValueEnum as _;
    for task in Task::ALL {
        let shown = task.to_possible_value().expect("no variant is skipped");
        assert_eq!(shown.get_name(), task.label(), "{task:?}");
        assert_eq!(task.cli_name(), task.label(), "{task:?}");
        // Every name also parses through `FromStr`, which the budget commands use.
        assert_eq!(task.label().parse::<Task>(), Ok(task));
    }
    assert_eq!(Task::CardStatus.label(), "card_status");
    let shown = Task::CardStatus.to_possible_value().expect("shown");
    assert!(shown.matches("card-status", false), "the alias");
    assert!(!shown.is_hide_set());
}

#[test]
fn serde_keeps_the_label_spelling_and_accepts_the_cli_one() {
    assert_eq!(
        serde_json::to_string(&Task::CardStatus).expect("json"),
        "\"card_status\""
    );
    assert_eq!(
        serde_json::from_str::<Task>("\"card-status\"").expect("alias"),
        Task::CardStatus
    );
}

#[test]
fn redaction_hides_passwords_only() {
    let mut c = Config::default();
    c.database.url = "postgres://app:s3cret@db:5432/cw?sslmode=verify-full".into();
    c.redis.url = "rediss://:r3dis@cache:6380/0".into();
    let r = c.redacted();
    assert_eq!(
        r.database.url.expose(),
        "postgres://app:***@db:5432/cw?sslmode=verify-full"
    );
    assert_eq!(r.redis.url.expose(), "rediss://:***@cache:6380/0");
    assert_eq!(r.gateway.base_url, c.gateway.base_url);
    let text = r.to_toml_string().expect("renders");
    assert!(
        !text.contains("s3cret") && !text.contains("r3dis"),
        "{text}"
    );
    let json = serde_json::to_string(&r).expect("json");
    assert!(!json.contains("s3cret"), "{json}");
    assert!(json.contains("\"log_format\":\"json\""), "{json}");
    // Without a password the URL is left as written.
    assert_eq!(
        Config::default().redacted().database.url,
        Config::default().database.url
    );
    assert_eq!(
        SecretUrl::new("postgres://db/cw?user=a&password=p").redacted(),
        "postgres://db/cw?user=a&password=***"
    );
}

#[test]
fn debug_of_a_config_never_shows_a_password() {
    let mut c = Config::default();
    c.database.url = "postgres://app:s3cret@db:5432/cw?password=qs3cret".into();
    c.redis.url = "rediss://:r3dis@cache:6380/0".into();
    c.gateway.base_url = "https://gw:g4te@gateway.example".into();
    for text in [format!("{c:?}"), format!("{c:#?}")] {
        for secret in ["s3cret", "qs3cret", "r3dis", "g4te"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert!(
            text.contains("\"postgres://app:***@db:5432/cw?password=***\""),
            "{text}"
        );
    }
    // The real value is still there for connecting.
    assert_eq!(c.redis.url.expose(), "rediss://:r3dis@cache:6380/0");
    assert_eq!(c.redis.url.to_string(), "rediss://:***@cache:6380/0");
}

#[test]
fn a_secret_url_renders_as_what_it_holds_in_toml() {
    let mut c = Config::default();
    c.redis.url = SecretUrl::new("redis://:pw@r:6379/0");
    let toml = c.to_toml_string().expect("renders");
    assert!(toml.contains("url = \"redis://:pw@r:6379/0\""), "{toml}");
}

#[test]
fn a_secret_url_reads_and_writes_as_a_plain_string() {
    let url = SecretUrl::new("redis://:pw@r:6379/0");
    assert_eq!(
        serde_json::to_string(&url).expect("json"),
        "\"redis://:pw@r:6379/0\""
    );
    let back: SecretUrl = serde_json::from_str("\"redis://:pw@r:6379/0\"").expect("json");
    assert_eq!(back, url);
    assert_eq!(SecretUrl::default().expose(), "");
    assert_eq!(format!("{:?}", SecretUrl::default()), "\"\"");
}

#[test]
fn a_limit_is_built_only_in_range_and_compares_and_serialises_as_its_number() {
    assert_eq!(Limit::new(1).map(Limit::get), Ok(1));
    assert_eq!(Limit::new(LIMIT_CEILING).map(Limit::get), Ok(256));
    for n in [0, 257, 100_000, u32::MAX] {
        assert_eq!(Limit::new(n), Err(LimitError::Refused), "{n}");
    }
    for n in [0_i64, -1, 257, 100_000, i64::MIN, i64::MAX] {
        assert_eq!(Limit::try_from(n), Err(LimitError::Refused), "{n}");
    }
    assert_eq!(Limit::try_from(4_i64).map(Limit::get), Ok(4));
    let l = Limit::new(8).expect("in range");
    assert!(l == 8 && l < 9 && l > 7);
    assert_eq!(l.to_string(), "8");
    assert_eq!(serde_json::to_string(&l).expect("serialise"), "8");
    assert_eq!(
        serde_json::from_str::<Limit>("4").map(Limit::get).ok(),
        Some(4)
    );
    for bad in ["0", "257", "-1", "3.5", "\"4\""] {
        assert!(serde_json::from_str::<Limit>(bad).is_err(), "{bad}");
    }
}
