-- Conveyor 0015: the fair claim reads each tenant's first events, not every
-- event of the pattern. `{schema}` is replaced by the quoted schema
-- identifier; this file holds no other braces on purpose.
--
-- flow_claim_fair (fair_by="tenant") numbered every due event of its pattern
-- per tenant at each claim: with one tenant's 100,000-event backlog, about a
-- quarter of a second a claim on a busy 2-core machine, so another tenant's
-- event waited up to 1.3 s (2026-12-02). This index holds only the limited
-- lane's events (the flow claims' own, 0013), by tenant in claim order: the
-- claim walks the tenants (one probe each) and reads each one's first few.
-- Events of unlimited topics never enter it.
CREATE INDEX events_fair_idx
    ON {schema}.events (tenant, priority DESC, run_at, id) INCLUDE (topic)
    WHERE state = 'pending' AND limited;
