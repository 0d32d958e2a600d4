//! The simulator's knobs: the global [`SimConfig`] and its runtime patch ([`SimConfigPatch`]),
//! and the behaviours that override it for one card ([`CardBehaviour`]) or one payment
//! ([`PaymentBehaviour`]).

use serde::{Deserialize, Serialize};

/// What the simulator answers to `POST /v1/payments` when no per-payment behaviour is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PaymentBehaviour {
    /// Store and answer `accepted`.
    #[default]
    Accept,
    /// Store and answer `rejected`.
    Reject,
    /// Answer 503 without storing.
    ServerError,
    /// Store as `accepted`, then hold the answer for `hang_ms` (longer than a client timeout):
    /// the Gateway acted but the caller does not know.
    Hang,
    /// Answer `accepted` but do not store: a later `GET` answers 404.
    Forget,
}

/// What a card endpoint answers for one card, overriding the global rates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "garbage")]
pub enum CardBehaviour {
    /// Use the global rates.
    #[default]
    Normal,
    /// Always 503.
    Fail,
    /// Always a 200 with a bad body of this kind.
    Garbage(GarbageKind),
}

/// The kinds of bad 2xx body the simulator can produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GarbageKind {
    /// Not JSON at all.
    #[default]
    NotJson,
    /// JSON lacking the `state` / `status` field.
    MissingField,
    /// JSON naming another card or payment.
    OtherRef,
    /// A `state` / `status` outside the list.
    BadValue,
}

impl GarbageKind {
    /// Every kind, the set a random bad body is drawn from.
    pub(crate) const ALL: [GarbageKind; 4] = [
        GarbageKind::NotJson,
        GarbageKind::MissingField,
        GarbageKind::OtherRef,
        GarbageKind::BadValue,
    ];
}

/// Global knobs of the simulator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    /// Base latency of every Gateway call.
    pub latency_ms: u64,
    /// Extra uniform random latency in `0..=latency_jitter_ms`.
    pub latency_jitter_ms: u64,
    /// Probability (0..=1) that a Gateway call answers 503.
    pub error_rate: f64,
    /// Probability (0..=1) that a Gateway call answers 200 with a bad body.
    pub garbage_rate: f64,
    /// Probability (0..=1) that a card changes on a given data or status read.
    pub change_rate: f64,
    /// Default behaviour of `POST /v1/payments`.
    pub payment_mode: PaymentBehaviour,
    /// How long a [`PaymentBehaviour::Hang`] holds its answer.
    pub hang_ms: u64,
    /// Probability (0..=1) that a new approval is answered `in_review`.
    pub approval_in_review_rate: f64,
    /// Probability (0..=1) that an approval is declined (at once, or after its review).
    pub approval_decline_rate: f64,
    /// How long an approval stays in review before the channel decides it.
    pub approval_review_ms: u64,
    /// How long every `POST /v1/payments|approvals` is held before the Gateway acts on it: the
    /// request is on the wire, and a `GET` meanwhile answers 404 (0: acts at once).
    pub post_act_delay_ms: u64,
    /// How long every `POST /v1/payments|approvals` holds its answer after the Gateway acted:
    /// longer than the client's timeout, the Gateway acted but the caller does not know (0: answers
    /// at once).
    pub post_answer_delay_ms: u64,
    /// Whether a `POST` whose `Idempotency-Key` is still being processed by an earlier `POST`
    /// (held by the two delays above, or by latency) is answered `409 Conflict`, without acting,
    /// as many idempotency stores do.
    pub conflict_concurrent_posts: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            latency_ms: 20,
            latency_jitter_ms: 0,
            error_rate: 0.0,
            garbage_rate: 0.0,
            change_rate: 0.0,
            payment_mode: PaymentBehaviour::Accept,
            hang_ms: 30_000,
            approval_in_review_rate: 0.0,
            approval_decline_rate: 0.0,
            approval_review_ms: 60_000,
            post_act_delay_ms: 0,
            post_answer_delay_ms: 0,
            conflict_concurrent_posts: false,
        }
    }
}

impl SimConfig {
    /// Checks that every rate is a probability.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (name, v) in [
            ("error_rate", self.error_rate),
            ("garbage_rate", self.garbage_rate),
            ("change_rate", self.change_rate),
            ("approval_in_review_rate", self.approval_in_review_rate),
            ("approval_decline_rate", self.approval_decline_rate),
        ] {
            if !(0.0..=1.0).contains(&v) {
                anyhow::bail!("{name} = {v} is not a probability in 0..=1");
            }
        }
        Ok(())
    }
}

/// A partial update of [`SimConfig`] (`POST /sim/config`): absent fields are kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfigPatch {
    pub latency_ms: Option<u64>,
    pub latency_jitter_ms: Option<u64>,
    pub error_rate: Option<f64>,
    pub garbage_rate: Option<f64>,
    pub change_rate: Option<f64>,
    pub payment_mode: Option<PaymentBehaviour>,
    pub hang_ms: Option<u64>,
    pub approval_in_review_rate: Option<f64>,
    pub approval_decline_rate: Option<f64>,
    pub approval_review_ms: Option<u64>,
    pub post_act_delay_ms: Option<u64>,
    pub post_answer_delay_ms: Option<u64>,
    pub conflict_concurrent_posts: Option<bool>,
}

impl SimConfigPatch {
    /// `c` with the fields this patch names replaced; not validated.
    pub(crate) fn apply(&self, c: &SimConfig) -> SimConfig {
        SimConfig {
            latency_ms: self.latency_ms.unwrap_or(c.latency_ms),
            latency_jitter_ms: self.latency_jitter_ms.unwrap_or(c.latency_jitter_ms),
            error_rate: self.error_rate.unwrap_or(c.error_rate),
            garbage_rate: self.garbage_rate.unwrap_or(c.garbage_rate),
            change_rate: self.change_rate.unwrap_or(c.change_rate),
            payment_mode: self.payment_mode.unwrap_or(c.payment_mode),
            hang_ms: self.hang_ms.unwrap_or(c.hang_ms),
            approval_in_review_rate: self
                .approval_in_review_rate
                .unwrap_or(c.approval_in_review_rate),
            approval_decline_rate: self
                .approval_decline_rate
                .unwrap_or(c.approval_decline_rate),
            approval_review_ms: self.approval_review_ms.unwrap_or(c.approval_review_ms),
            post_act_delay_ms: self.post_act_delay_ms.unwrap_or(c.post_act_delay_ms),
            post_answer_delay_ms: self.post_answer_delay_ms.unwrap_or(c.post_answer_delay_ms),
            conflict_concurrent_posts: self
                .conflict_concurrent_posts
                .unwrap_or(c.conflict_concurrent_posts),
        }
    }
}

/// A rate forced into 0..=1 (NaN counts as 0), for the setters that clamp instead of refusing.
pub(crate) fn clamp01(v: f64) -> f64 {
    if v.is_nan() {
        0.0
    } else {
        v.clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_default_config_is_valid_never_disturbs_and_accepts_payments() {
        let c = SimConfig::default();
        c.validate().unwrap();
        assert_eq!(
            (c.error_rate, c.garbage_rate, c.change_rate),
            (0.0, 0.0, 0.0)
        );
        assert_eq!(c.payment_mode, PaymentBehaviour::Accept);
        assert_eq!(c.latency_ms, 20);
        assert_eq!(c.hang_ms, 30_000);
    }

    #[test]
    fn an_empty_patch_keeps_every_field() {
        let c = SimConfig {
            latency_ms: 7,
            latency_jitter_ms: 3,
            error_rate: 0.1,
            garbage_rate: 0.2,
            change_rate: 0.3,
            payment_mode: PaymentBehaviour::Hang,
            hang_ms: 99,
            approval_in_review_rate: 0.4,
            approval_decline_rate: 0.5,
            approval_review_ms: 11,
            post_act_delay_ms: 12,
            post_answer_delay_ms: 13,
            conflict_concurrent_posts: true,
        };
        assert_eq!(SimConfigPatch::default().apply(&c), c);
    }

    #[test]
    fn a_patch_replaces_only_the_fields_it_names() {
        let patch = SimConfigPatch {
            error_rate: Some(1.0),
            payment_mode: Some(PaymentBehaviour::Reject),
            ..SimConfigPatch::default()
        };
        let next = patch.apply(&SimConfig::default());
        assert_eq!(
            next,
            SimConfig {
                error_rate: 1.0,
                payment_mode: PaymentBehaviour::Reject,
                ..SimConfig::default()
            }
        );
    }

    #[test]
    fn config_patch_validation_refuses_every_rate_outside_zero_to_one() {
        for bad in [-0.01, 1.01, f64::NAN, f64::INFINITY] {
            for (name, patch) in [
                (
                    "error_rate",
                    SimConfigPatch {
                        error_rate: Some(bad),
                        ..SimConfigPatch::default()
                    },
                ),
                (
                    "garbage_rate",
                    SimConfigPatch {
                        garbage_rate: Some(bad),
                        ..SimConfigPatch::default()
                    },
                ),
                (
                    "change_rate",
                    SimConfigPatch {
                        change_rate: Some(bad),
                        ..SimConfigPatch::default()
                    },
                ),
            ] {
                let err = patch
                    .apply(&SimConfig::default())
                    .validate()
                    .expect_err("an out-of-range rate is refused");
                assert!(err.to_string().contains(name), "{name} = {bad}: {err}");
            }
        }
    }

    #[test]
    fn config_patch_validation_accepts_the_bounds_zero_and_one() {
        for ok in [0.0, 1.0] {
            SimConfigPatch {
                error_rate: Some(ok),
                garbage_rate: Some(ok),
                change_rate: Some(ok),
                ..SimConfigPatch::default()
            }
            .apply(&SimConfig::default())
            .validate()
            .unwrap();
        }
    }

    #[test]
    fn a_config_patch_with_an_unknown_field_does_not_parse() {
        let r = serde_json::from_value::<SimConfigPatch>(json!({"error_rate": 0.5, "eror": 1}));
        assert!(r.is_err());
    }

    #[test]
    fn clamping_forces_a_rate_into_zero_to_one_and_nan_to_zero() {
        assert_eq!(clamp01(-3.0), 0.0);
        assert_eq!(clamp01(0.25), 0.25);
        assert_eq!(clamp01(7.0), 1.0);
        assert_eq!(clamp01(f64::NAN), 0.0);
    }

    #[test]
    fn behaviours_use_the_json_names_of_the_control_api() {
        assert_eq!(
            serde_json::to_value(PaymentBehaviour::ServerError).unwrap(),
            json!("server_error")
        );
        assert_eq!(
            serde_json::to_value(CardBehaviour::Fail).unwrap(),
            json!({"kind": "fail"})
        );
        assert_eq!(
            serde_json::to_value(CardBehaviour::Garbage(GarbageKind::OtherRef)).unwrap(),
            json!({"kind": "garbage", "garbage": "other_ref"})
        );
        let back: CardBehaviour =
            serde_json::from_value(json!({"kind": "garbage", "garbage": "bad_value"})).unwrap();
        assert_eq!(back, CardBehaviour::Garbage(GarbageKind::BadValue));
    }
}
