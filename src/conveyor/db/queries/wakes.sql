-- The wake gate: a producer sends a wake-up only while somebody waits for one
-- (docs/producing.md, "Wake-ups"). `{channel}` is replaced by the schema's
-- wake-up channel.
--
-- A NOTIFY costs its transaction a global lock at COMMIT, which PostgreSQL
-- holds while it appends to the notification queue: it is most of what an
-- event written in a transaction of its own costs beyond a plain INSERT, and
-- concurrent producers commit one after another behind it. A worker that
-- claims whole batches reads what comes without being woken, so while every
-- worker is busy the wake-ups are wasted. Whoever waits for them (a worker
-- whose last claim came back short, a parked tenant, an ordered relay
-- stream) holds the gate's eight slots in share mode, session-level advisory
-- locks; a producer tries its slot in exclusive mode for its transaction. It
-- gets it only when nobody waits, and then sends nothing; otherwise it wakes
-- them as before. A waiter that finds a slot taken (a producer that sent
-- nothing has not committed yet) reads again when it gets it, so no event
-- is left for the poll. Eight slots (by backend pid), so concurrent
-- producers seldom meet on one; a producer that does wakes the waiters for
-- nothing, as every producer did before.

-- name: _wake_gate_slot(slot)
-- The lock of slot `slot` (0-7): the channel's hash, and the slot past a
-- constant of Conveyor's ("CW" and two zero bytes), apart from the metrics
-- lock's keys (metrics/queries.sql) and from locks an application takes.
hashtext({channel}), 1129775104 + {slot}

-- name: _wake_gate_passed
-- True when nobody waits: the producer then holds its slot until it ends.
pg_try_advisory_xact_lock(-- include: _wake_gate_slot(mod(pg_backend_pid(), 8))
)

-- name: wake_gate_hold
-- Holds the slots not held yet (`held`: a bit per slot); returns the slots
-- held now. A slot a producer holds is not taken, and no wait blocks.
SELECT coalesce(sum(1 << s), 0)::int
FROM generate_series(0, 7) AS s
WHERE CASE WHEN (%(held)s::int & (1 << s)) <> 0 THEN true
           ELSE pg_try_advisory_lock_shared(-- include: _wake_gate_slot(s)
                )
      END

-- name: wake_gate_release
-- Releases the slots `held` names (a bit per slot).
SELECT count(pg_advisory_unlock_shared(-- include: _wake_gate_slot(s)
             ))
FROM generate_series(0, 7) AS s
WHERE (%(held)s::int & (1 << s)) <> 0
