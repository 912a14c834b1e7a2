-- Named queries of the multi-tenant worker (conveyor.tenancy). `{schema}` is
-- replaced by the quoted schema identifier; parameters are always bound.

-- name: tenant_due
-- Whether a parked tenant's database has something for a worker to do now:
-- an event its routes would claim (the open lane, as event_claim_unpaused
-- picks it; or the limited lane, which the flow claims take), or a running
-- event whose lease has run out (its worker was lost: a turn's maintenance
-- pass rescues it), or a cron schedule due to fire. Asked of every parked tenant at every poll, so each
-- branch stops at its first row: events_claim_idx and events_lease_idx lead
-- with the state, and a pause is tested only against the candidates found.
-- A due event a turn could still not claim (a flow limit in force elsewhere)
-- costs that tenant a short turn per poll interval, never a lost event.
SELECT EXISTS (
           SELECT 1
           -- include: _claim_candidates
           -- include: _claim_unpaused
       )
       OR EXISTS (
           SELECT 1 FROM {schema}.events
           WHERE state = 'pending' AND limited AND run_at <= now()
             -- include: _claim_filter
             -- include: _claim_unpaused
       )
       OR EXISTS (
           SELECT 1 FROM {schema}.events
           WHERE state = 'running' AND lease_expires_at < now()
       )
       -- A schedule of its router to fire: only a router with schedules asks
       -- (`cron`), or another's rows would give that tenant empty turns.
       OR (%(cron)s AND EXISTS (
           SELECT 1 FROM {schema}.cron_schedules
           WHERE enabled AND next_fire_at <= now()
       )) AS due
