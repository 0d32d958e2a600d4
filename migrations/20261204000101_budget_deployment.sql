-- The deployment's first worker start, written once (one row at most), before the polling budget
-- admits its first poll. A Redis that holds no fence hash is then known to have lost the
-- deployment's data, rather than never to have held it: the budget fences it (src/budget/budget.lua,
-- "The fence").
CREATE TABLE budget_deployment (
    id boolean PRIMARY KEY DEFAULT TRUE CHECK (id),
    started_at timestamptz NOT NULL DEFAULT now()
);
