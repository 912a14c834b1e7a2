"""A small but real application ("the engine") integrating Conveyor as a transactional outbox."""
