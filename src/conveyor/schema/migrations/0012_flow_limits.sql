-- Conveyor 0012: flow control of routes, shared by every worker.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- A route with max_running, rate or fair_by (docs/flow-control.md) declares
-- its pattern here when its worker starts. Every worker reads the table: the
-- events of a limited pattern are left out of the plain claim and taken only
-- by the flow claim, which locks the pattern's row (so claims of one pattern
-- run one at a time, fleet-wide), counts its running events with a fresh
-- snapshot, and takes at most what the limit and the token bucket allow.
-- `tokens` and `refilled_at` are the rate limit's bucket: it refills at
-- `rate` per second up to `burst`, and every claimed attempt takes a token.
CREATE TABLE {schema}.flow_limits (
    pattern     text        PRIMARY KEY,
    max_running integer,
    rate        float8,
    burst       float8,
    fair_by     text,
    tokens      float8      NOT NULL DEFAULT 0,
    refilled_at timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
