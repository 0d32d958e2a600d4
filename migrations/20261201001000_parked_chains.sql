-- Parked chains, by when they were parked (partial: only parked cards are in them). They serve
-- `cardworker unpark --parked-before TS` and `--all` (batched walks), the parked chains' retry
-- safety net in reconcile (cards whose retry is overdue after a Redis loss), and the
-- cardworker_parked_chains{task} gauge (an index-only count of the parked cards).
CREATE INDEX cards_carddata_parked_idx ON cards (carddata_parked_at)
    WHERE carddata_parked_at IS NOT NULL;
CREATE INDEX cards_card_status_parked_idx ON cards (card_status_parked_at)
    WHERE card_status_parked_at IS NOT NULL;
