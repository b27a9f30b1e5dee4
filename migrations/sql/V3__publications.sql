-- One publication per outbox, inserts only: retention deletes are never published.
-- CREATE PUBLICATION needs table ownership (or superuser), so it lives here rather than in
-- the relay. The publication must exist before the relay's slot is created
-- (`cdc-relay setup`): a slot created first fails with "publication ... does not exist"
-- for good, even after the publication appears.
CREATE PUBLICATION consumers_outbox FOR TABLE consumers.outbox WITH (publish = 'insert');
CREATE PUBLICATION workers_outbox   FOR TABLE workers.outbox   WITH (publish = 'insert');
