-- A relay rebuilds its stream from the outbox table when its slot was lost or Redis lost
-- data (cdc-relay --on-lost-slot recover, and the lost-Redis check at start). For that, and
-- only that, each relay role may read its own side's outbox; nothing else, and never the
-- other side.
GRANT USAGE ON SCHEMA consumers TO consumers_relay;
GRANT SELECT ON consumers.outbox TO consumers_relay;
GRANT USAGE ON SCHEMA workers TO workers_relay;
GRANT SELECT ON workers.outbox TO workers_relay;
