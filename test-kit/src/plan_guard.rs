//! The plan guard's reader and checker: which executed plan reads a whole big table.
//!
//! cardworker exists to keep one PostgreSQL disk healthy, so a product statement that reads a
//! whole big table (or a whole index of one) is a defect wherever it runs. The guard test
//! (`plans.rs`) runs every statement path of `src/` against a private cluster that logs every
//! executed plan (`auto_explain`, JSON, into `jsonlog`) and plans with `enable_seqscan = off`;
//! this module reads that log and judges each plan. `benches/bench_plans.rs` reuses it at
//! production volumes.
//!
//! What counts as reading the whole table, on a [`GUARDED_TABLES`] table:
//! - a `Seq Scan` (with seq scans disabled the planner still picks one only where no index can
//!   serve the statement);
//! - an index scan (plain, index-only or bitmap) without a condition on the index's leading
//!   column: it walks the whole index (how the old RUNBOOK count of `created_at` ran on
//!   `integration_logs_resource_idx`);
//! - an index scan whose condition pins only [`LOW_CARDINALITY_COLUMNS`] of the index's leading
//!   columns: it reads every row of one kind, for example every `payment` callback. With seq
//!   scans disabled this is what the planner turns a seq scan into when an index on such a
//!   column exists (the old `investigate` callbacks read, `resource_id IN (SELECT …)`).
//!
//! Extending it: a new big table goes into [`GUARDED_TABLES`]; a new column with a handful of
//! values that leads an index goes into [`LOW_CARDINALITY_COLUMNS`].

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

/// The tables a statement must never read whole (`*`: every table with that prefix, so the
/// archive tables are included).
pub const GUARDED_TABLES: &[&str] = &[
    "cards",
    "integration_logs*",
    "audit_events*",
    "audit_resources*",
    "outbox_events",
    "payments",
    "inbound_callbacks",
    "approvals",
];

/// Columns with a handful of distinct values. An index condition that pins only these (of the
/// index's leading columns) still reads a large share of the table.
pub const LOW_CARDINALITY_COLUMNS: &[&str] = &[
    "resource_type",
    "channel",
    "state",
    "status",
    "data_state",
    "kind",
    "scenario",
    "event_type",
    "aggregate_type",
];

/// Partial indexes that a statement may read whole, because the index holds only a set the
/// product keeps small, with the reason. Everything else that reads an index whole fails.
pub const WHOLE_READ_ALLOWED: &[(&str, &str)] = &[
    (
        "cards_carddata_parked_idx",
        "cardworker_parked_chains counts the partial index of parked cards: it holds \
         only parked chains, which the circuit breaker keeps few",
    ),
    (
        "cards_card_status_parked_idx",
        "cardworker_parked_chains counts the partial index of parked cards",
    ),
    (
        "payments_unsettled_idx",
        "the console's money page lists unsettled payments, oldest first, LIMIT 50: the partial \
         index holds only payments recovery has not settled yet",
    ),
    (
        "inbound_callbacks_failed_idx",
        "the console's money page lists the newest failed callbacks, LIMIT 50: the partial index \
         holds only failed callbacks",
    ),
];

/// Whether `table` is guarded.
pub fn is_guarded(table: &str) -> bool {
    GUARDED_TABLES.iter().any(|g| match g.strip_suffix('*') {
        Some(prefix) => table.starts_with(prefix),
        None => table == *g,
    })
}

/// One plan as auto_explain logged it.
#[derive(Debug, Clone)]
pub struct LoggedPlan {
    /// The session's `application_name` (empty for the product's pool).
    pub application_name: String,
    /// The database.
    pub dbname: String,
    /// The statement's duration as logged.
    pub duration_ms: f64,
    /// The statement text (`$n` parameters as sent).
    pub query: String,
    /// The plan tree (`"Plan"` of auto_explain's JSON).
    pub plan: Value,
}

impl LoggedPlan {
    /// The statement on one line (white space folded), as the guard names it.
    pub fn statement(&self) -> String {
        fold_whitespace(&self.query)
    }
}

/// Folds every run of white space into one space.
pub fn fold_whitespace(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Reads every auto_explain entry of a `jsonlog` text (one JSON object a line). Other entries
/// (errors, checkpoints, connections) are skipped.
pub fn parse_log(text: &str) -> Vec<LoggedPlan> {
    text.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter_map(|entry| {
            let message = entry.get("message")?.as_str()?;
            let rest = message.strip_prefix("duration: ")?;
            let (duration, plan_text) = rest.split_once(" ms  plan:\n")?;
            let explained: Value = serde_json::from_str(plan_text).ok()?;
            Some(LoggedPlan {
                application_name: text_field(&entry, "application_name"),
                dbname: text_field(&entry, "dbname"),
                duration_ms: duration.trim().parse().unwrap_or(0.0),
                query: explained.get("Query Text")?.as_str()?.to_owned(),
                plan: explained.get("Plan")?.clone(),
            })
        })
        .collect()
}

fn text_field(entry: &Value, key: &str) -> String {
    entry
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// An index as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexInfo {
    /// The table it indexes.
    pub table: String,
    /// Its key columns in order (an expression column is `(expression)`).
    pub columns: Vec<String>,
}

/// Index name -> its table and columns.
pub type Indexes = BTreeMap<String, IndexInfo>;

/// The catalog query behind [`Indexes`] (one row per index: name, table, key columns).
pub const INDEXES_SQL: &str = "SELECT i.relname::text, t.relname::text,
        array_agg(coalesce(a.attname::text, '(expression)') ORDER BY k.ord)
   FROM pg_index x
   JOIN pg_class i ON i.oid = x.indexrelid
   JOIN pg_class t ON t.oid = x.indrelid
   JOIN pg_namespace n ON n.oid = t.relnamespace
   CROSS JOIN LATERAL unnest(x.indkey[0:x.indnkeyatts - 1]) WITH ORDINALITY AS k(attnum, ord)
   LEFT JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum AND k.attnum > 0
  WHERE n.nspname = current_schema()
  GROUP BY i.relname, t.relname";

/// Reads [`Indexes`] of the current schema.
pub async fn read_indexes(pool: &sqlx::PgPool) -> Indexes {
    let rows: Vec<(String, String, Vec<String>)> = sqlx::query_as(INDEXES_SQL)
        .fetch_all(pool)
        .await
        .expect("reading the index catalog");
    rows.into_iter()
        .map(|(name, table, columns)| (name, IndexInfo { table, columns }))
        .collect()
}

/// One plan node that reads a whole guarded table, and the statement it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The statement, on one line.
    pub statement: String,
    /// The node, for example `Seq Scan on inbound_callbacks`.
    pub node: String,
    /// Why it reads the whole table.
    pub why: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}\n    statement: {}",
            self.node, self.why, self.statement
        )
    }
}

/// Every violation in one plan.
pub fn check(plan: &LoggedPlan, indexes: &Indexes) -> Vec<Violation> {
    let mut out = Vec::new();
    walk(&plan.plan, None, &mut |node, heap_alias| {
        if let Some((node_name, why)) = judge(node, heap_alias, indexes) {
            out.push(Violation {
                statement: plan.statement(),
                node: node_name,
                why,
            });
        }
    });
    out
}

/// Visits every node of a plan tree, with the alias of the nearest `Bitmap Heap Scan` above it
/// (a `Bitmap Index Scan` names no relation of its own).
fn walk<'a>(
    node: &'a Value,
    heap_alias: Option<&'a str>,
    visit: &mut impl FnMut(&'a Value, Option<&'a str>),
) {
    visit(node, heap_alias);
    let alias = if node_type(node) == "Bitmap Heap Scan" {
        node.get("Alias").and_then(Value::as_str)
    } else {
        heap_alias
    };
    if let Some(children) = node.get("Plans").and_then(Value::as_array) {
        for child in children {
            walk(child, alias, visit);
        }
    }
}

fn node_type(node: &Value) -> &str {
    node.get("Node Type").and_then(Value::as_str).unwrap_or("")
}

/// `Some((node, why))` when this node reads a whole guarded table.
fn judge(node: &Value, heap_alias: Option<&str>, indexes: &Indexes) -> Option<(String, String)> {
    let kind = node_type(node);
    let relation = node.get("Relation Name").and_then(Value::as_str);
    if kind == "Seq Scan" {
        let table = relation?;
        return is_guarded(table).then(|| {
            (
                format!("Seq Scan on {table}"),
                "reads the whole table".to_owned(),
            )
        });
    }
    if !matches!(kind, "Index Scan" | "Index Only Scan" | "Bitmap Index Scan") {
        return None;
    }
    let index = node.get("Index Name").and_then(Value::as_str)?;
    let Some(info) = indexes.get(index) else {
        let table = relation.unwrap_or("?");
        return is_guarded(table).then(|| {
            (
                format!("{kind} using {index} on {table}"),
                "the index is not in the catalog snapshot, so its columns are unknown".to_owned(),
            )
        });
    };
    if !is_guarded(&info.table) {
        return None;
    }
    let alias = node
        .get("Alias")
        .and_then(Value::as_str)
        .or(heap_alias)
        .unwrap_or(&info.table);
    let cond = node.get("Index Cond").and_then(Value::as_str).unwrap_or("");
    let constrained = constrained_columns(cond, alias, &info.columns);
    let prefix: Vec<&String> = info
        .columns
        .iter()
        .take_while(|c| constrained.contains(c))
        .collect();
    let name = format!("{kind} using {index} on {}", info.table);
    if prefix.is_empty()
        && WHOLE_READ_ALLOWED
            .iter()
            .any(|(allowed, _)| *allowed == index)
    {
        return None;
    }
    if prefix.is_empty() {
        return Some((
            name,
            format!(
                "no condition on the index's leading column {:?} (condition: {}): reads the whole index",
                info.columns.first().map_or("?", String::as_str),
                if cond.is_empty() { "none" } else { cond }
            ),
        ));
    }
    if prefix
        .iter()
        .all(|c| LOW_CARDINALITY_COLUMNS.contains(&c.as_str()))
    {
        return Some((
            name,
            format!(
                "the condition {cond} pins only low-cardinality column(s) {prefix:?}: reads every row of that kind"
            ),
        ));
    }
    None
}

/// The index columns an index condition constrains: identifiers of the condition that name one
/// of `columns`, unqualified or qualified by the scanned relation's `alias` (the other side of a
/// join condition, `r.audit_event_id`, is not a column of this index). Quoted strings are not
/// identifiers.
pub fn constrained_columns(cond: &str, alias: &str, columns: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for (qualifier, ident) in identifiers(cond) {
        let ours = qualifier.as_deref().is_none_or(|q| q == alias);
        if ours && columns.contains(&ident) && !found.contains(&ident) {
            found.push(ident);
        }
    }
    found
}

/// The identifiers of an expression as (qualifier, name): `r.resource_id` is
/// `(Some("r"), "resource_id")`; `'card'::text` yields only `text`.
fn identifiers(expr: &str) -> Vec<(Option<String>, String)> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut pending_qualifier: Option<String> = None;
    while i < chars.len() {
        let c = chars[i];
        if c == '\'' {
            // A string literal ('' is an escaped quote inside it).
            i += 1;
            while i < chars.len() {
                if chars[i] == '\'' {
                    if chars.get(i + 1) == Some(&'\'') {
                        i += 2;
                        continue;
                    }
                    break;
                }
                i += 1;
            }
            i += 1;
            pending_qualifier = None;
            continue;
        }
        let ident = if c == '"' {
            let start = i + 1;
            i = start;
            while i < chars.len() && chars[i] != '"' {
                i += 1;
            }
            let s: String = chars[start..i.min(chars.len())].iter().collect();
            i += 1;
            Some(s)
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_alphanumeric() || chars[i] == '_' || chars[i] == '$')
            {
                i += 1;
            }
            Some(chars[start..i].iter().collect())
        } else {
            i += 1;
            None
        };
        match ident {
            Some(name) if chars.get(i) == Some(&'.') => {
                pending_qualifier = Some(name);
                i += 1;
            }
            Some(name) => out.push((pending_qualifier.take(), name)),
            None => pending_qualifier = None,
        }
    }
    out
}

/// The plan's shape on one line: node types with their relation or index, children after `>`
/// (several in parentheses, separated by `;`).
pub fn shape(node: &Value) -> String {
    let kind = node_type(node);
    let mut s = kind.to_owned();
    if let Some(index) = node.get("Index Name").and_then(Value::as_str) {
        s.push_str(&format!(" using {index}"));
    } else if let Some(rel) = node.get("Relation Name").and_then(Value::as_str) {
        s.push_str(&format!(" on {rel}"));
    }
    let children: Vec<String> = node
        .get("Plans")
        .and_then(Value::as_array)
        .map(|c| c.iter().map(shape).collect())
        .unwrap_or_default();
    match children.len() {
        0 => s,
        1 => format!("{s} > {}", children[0]),
        _ => format!("{s} > ({})", children.join("; ")),
    }
}

/// The form of the `investigate` callbacks read the product no longer runs: the payment half,
/// `resource_id IN (SELECT …)`, cannot use the index. Kept to prove that the guard catches it.
pub const OLD_CALLBACKS_SQL: &str =
    "SELECT channel, callback_id, state, reason, resource_type, resource_id, deliveries,
        first_received_at, last_received_at, applied_at
   FROM inbound_callbacks
  WHERE (resource_type = 'card' AND resource_id = $1)
     OR (resource_type = 'payment'
         AND resource_id IN (SELECT payment_id::text FROM payments WHERE card_ref = $1))
  ORDER BY last_received_at DESC LIMIT $2";

#[cfg(test)]
mod tests {
    use super::*;

    /// The catalog of the product's schema, for the fixtures.
    fn indexes() -> Indexes {
        let idx = |name: &str, table: &str, cols: &[&str]| {
            (
                name.to_owned(),
                IndexInfo {
                    table: table.to_owned(),
                    columns: cols.iter().map(|c| (*c).to_owned()).collect(),
                },
            )
        };
        [
            idx("inbound_callbacks_pkey", "inbound_callbacks", &["id"]),
            idx(
                "inbound_callbacks_resource_idx",
                "inbound_callbacks",
                &["resource_type", "resource_id"],
            ),
            idx("payments_card_idx", "payments", &["card_ref", "created_at"]),
            idx(
                "integration_logs_resource_idx",
                "integration_logs",
                &["resource_type", "resource_id", "created_at"],
            ),
            idx(
                "integration_logs_finished_created_idx",
                "integration_logs",
                &["created_at"],
            ),
            idx(
                "audit_resources_resource_idx",
                "audit_resources",
                &["resource_type", "resource_id", "created_at"],
            ),
            idx("audit_events_pkey", "audit_events", &["id"]),
        ]
        .into_iter()
        .collect()
    }

    /// Real auto_explain entries (jsonlog lines) captured from private clusters; see each test.
    const FIXTURES: &str = include_str!("fixtures/plan_guard.jsonl");

    fn fixture(containing: &str) -> LoggedPlan {
        parse_log(FIXTURES)
            .into_iter()
            .find(|p| p.statement().contains(containing))
            .unwrap_or_else(|| panic!("no fixture plan whose statement contains {containing:?}"))
    }

    #[test]
    fn the_old_callbacks_read_is_caught_with_seq_scans_disabled() {
        // Logged by the guard's own cluster (enable_seqscan = off, a handful of rows): the
        // planner avoids the disabled seq scan with a bitmap scan of every `payment` callback.
        let plan = fixture("resource_id IN (SELECT payment_id::text");
        let found = check(&plan, &indexes());
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!(
            found[0].node,
            "Bitmap Index Scan using inbound_callbacks_resource_idx on inbound_callbacks"
        );
        assert!(found[0].why.contains("low-cardinality"), "{}", found[0]);
        assert!(
            found[0].statement.contains("FROM inbound_callbacks"),
            "the violation names the statement: {}",
            found[0]
        );
    }

    #[test]
    fn the_old_callbacks_read_at_production_volume_is_caught_as_a_seq_scan() {
        // Logged by `make bench-plans` (1M callbacks, seq scans allowed): a parallel seq scan.
        let plan = parse_log(FIXTURES)
            .into_iter()
            .find(|p| {
                p.statement()
                    .contains("resource_id IN (SELECT payment_id::text")
                    && shape(&p.plan).contains("Seq Scan")
            })
            .expect("the production-volume fixture");
        let found = check(&plan, &indexes());
        assert!(
            found
                .iter()
                .any(|v| v.node == "Seq Scan on inbound_callbacks"
                    && v.why == "reads the whole table"),
            "{found:#?}"
        );
    }

    #[test]
    fn the_callbacks_read_through_an_array_of_payment_ids_passes() {
        let plan = fixture("resource_id = ANY (ARRAY(SELECT payment_id::text");
        assert_eq!(check(&plan, &indexes()), Vec::<Violation>::new());
        assert!(
            shape(&plan.plan).contains("BitmapOr"),
            "{}",
            shape(&plan.plan)
        );
    }

    #[test]
    fn a_count_by_a_non_leading_column_is_caught_as_a_whole_index_read() {
        // The old RUNBOOK check, `count(*) … WHERE created_at > now() - interval '15 minutes'`.
        let plan = fixture("FROM integration_logs WHERE created_at >");
        let found = check(&plan, &indexes());
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(
            found[0]
                .why
                .contains("no condition on the index's leading column \"resource_type\""),
            "{}",
            found[0]
        );
        // With `state <> 'pending'` it is a range of the partial created_at index.
        let fixed = fixture("WHERE state <> 'pending' AND created_at >");
        assert_eq!(check(&fixed, &indexes()), Vec::<Violation>::new());
    }

    fn node(kind: &str, extra: Value) -> Value {
        let mut n = serde_json::json!({ "Node Type": kind });
        if let (Some(n), Some(e)) = (n.as_object_mut(), extra.as_object()) {
            n.extend(e.clone());
        }
        n
    }

    fn plan_of(root: Value) -> LoggedPlan {
        LoggedPlan {
            application_name: String::new(),
            dbname: "db".to_owned(),
            duration_ms: 0.1,
            query: "SELECT  1\n FROM x".to_owned(),
            plan: root,
        }
    }

    #[test]
    fn seq_scans_count_only_on_guarded_tables() {
        for (table, caught) in [
            ("cards", true),
            ("integration_logs_archive", true),
            ("audit_resources", true),
            ("approvals", true),
            ("_sqlx_migrations", false),
            ("pg_class", false),
            ("cards_extra", false),
        ] {
            let plan = plan_of(node(
                "Seq Scan",
                serde_json::json!({ "Relation Name": table }),
            ));
            assert_eq!(!check(&plan, &indexes()).is_empty(), caught, "{table}");
        }
    }

    #[test]
    fn a_join_condition_counts_only_the_scanned_side() {
        // audit_events e joined to audit_resources r: `id = r.audit_event_id` pins e.id.
        let inner = node(
            "Index Scan",
            serde_json::json!({
                "Index Name": "audit_events_pkey", "Relation Name": "audit_events",
                "Alias": "e", "Index Cond": "(id = r.audit_event_id)"
            }),
        );
        let outer = node(
            "Index Scan",
            serde_json::json!({
                "Index Name": "audit_resources_resource_idx", "Relation Name": "audit_resources",
                "Alias": "r",
                "Index Cond": "((r.resource_type = 'card'::text) AND (r.resource_id = $1))"
            }),
        );
        let root = node(
            "Nested Loop",
            serde_json::json!({ "Plans": [outer, inner] }),
        );
        assert_eq!(check(&plan_of(root), &indexes()), Vec::<Violation>::new());

        // The same index probed by the other side's column only is a whole-index read.
        let wrong = node(
            "Index Scan",
            serde_json::json!({
                "Index Name": "audit_resources_resource_idx", "Relation Name": "audit_resources",
                "Alias": "r", "Index Cond": "(e.resource_type = r.created_at)"
            }),
        );
        let found = check(&plan_of(wrong), &indexes());
        assert_eq!(found.len(), 1, "{found:#?}");
    }

    #[test]
    fn quoted_strings_and_casts_are_not_columns() {
        let cols = vec!["resource_type".to_owned(), "resource_id".to_owned()];
        assert_eq!(
            constrained_columns("(resource_type = 'resource_id'::text)", "t", &cols),
            ["resource_type"]
        );
        assert_eq!(
            constrained_columns("(x.resource_id = 'it''s'::text)", "t", &cols),
            Vec::<String>::new()
        );
        assert_eq!(
            constrained_columns("(\"resource_id\" = ANY ($0))", "t", &cols),
            ["resource_id"]
        );
    }

    #[test]
    fn a_log_line_that_is_not_a_plan_is_skipped_and_plans_keep_their_session() {
        let text = [
            r#"{"error_severity":"LOG","message":"checkpoint starting: time"}"#,
            "not json at all",
            r#"{"error_severity":"LOG","application_name":"cardworker-test-harness","dbname":"d","message":"duration: 1.250 ms  plan:\n{\"Query Text\": \"SELECT 1\", \"Plan\": {\"Node Type\": \"Result\"}}"}"#,
        ]
        .join("\n");
        let plans = parse_log(&text);
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].application_name, "cardworker-test-harness");
        assert_eq!(plans[0].duration_ms, 1.25);
        assert_eq!(plans[0].statement(), "SELECT 1");
        assert_eq!(shape(&plans[0].plan), "Result");
    }
}
