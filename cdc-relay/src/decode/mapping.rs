//! The outbox mapping: which columns of which table make a stream entry's fields.
//!
//! Two presets name every column: `chat` (this project's table: `id, event, payload,
//! created_at`, optional `partition_key` and `traceparent`) and `debezium` (the Outbox Event
//! Router's defaults: `id uuid, aggregatetype, aggregateid, type, payload`). Each column can be
//! renamed by a flag, under our name or Debezium's option name, and extra columns become
//! entry fields of their own (Debezium's `table.fields.additional.placement`).
//!
//! Invariants: the entry's field names are the stream contract's whatever the columns are
//! called (`event`, `payload`, `outbox_id`, `created_at`, `key`, `traceparent`, then the
//! extra fields under their aliases); no alias may take a contract name or another alias; and
//! every identifier is a plain lowercase Postgres name, so the relay's queries can quote it
//! without escaping.

use std::fmt;

use super::OutboxTable;

/// Names of the presets, as `--outbox-preset` takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Preset {
    /// This project's outbox: `id bigint, event, payload jsonb, created_at`, optional
    /// `partition_key` (the key) and `traceparent`.
    #[default]
    Chat,
    /// Debezium's Outbox Event Router defaults: `id uuid, aggregatetype, aggregateid (the
    /// key), type, payload`; no timestamp, no trace context.
    Debezium,
}

/// Where the relay gets back what a stream lost (`--outbox-recovery`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Recovery {
    /// From the outbox table, by its order and tx columns: a shard may fall behind and be
    /// caught up, and a Redis that lost its data is rebuilt.
    #[default]
    Table,
    /// From the slot only (a table without the two columns, such as Debezium's unmodified,
    /// whose producers may delete each row as they write it): no shard falls behind, and
    /// what Redis loses is lost.
    SlotOnly,
}

/// A column the mapping names; checked to be a plain lowercase identifier.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ident(String);

impl Ident {
    /// `name` when it is 1–63 lowercase letters, digits and underscores, not starting with a
    /// digit (what the relay can put in a query quoted, with nothing to escape).
    pub fn parse(name: &str) -> Option<Self> {
        let valid = !name.is_empty()
            && name.len() <= 63
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && !name.starts_with(|c: char| c.is_ascii_digit());
        valid.then(|| Self(name.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `"name"`, for a query.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }

    /// The column of table alias `alias` as text the way pgoutput sends it: its type's output
    /// function, NULL kept. Not `::text`, which differs for some types (`char(n)` drops its
    /// padding, `boolean` says `true` for `t`, `inet` adds the mask): a row caught up from the
    /// table must land in the stream and shard, with the fields, it would have had live.
    pub fn as_sent(&self, alias: &str) -> String {
        let c = format!("{alias}.{}", self.quoted());
        format!("(CASE WHEN {c} IS NULL THEN NULL ELSE format('%s', {c}) END)")
    }

    fn of(name: &'static str) -> Self {
        Self(name.to_string())
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An extra column placed in the entry as a field of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraField {
    pub column: Ident,
    /// The entry's field name (the column's unless aliased).
    pub field: String,
}

/// Which column is which, for one outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMapping {
    pub table: OutboxTable,
    /// The row's id (`outbox_id`): any type, published as Postgres prints it.
    pub id: Ident,
    /// The key (`key`): what picks the shard, so the order unit; published too. A table
    /// without the column (or a NULL) puts the row in shard 0 with no `key` field.
    pub key: Ident,
    /// The event type (`event`).
    pub event_type: Ident,
    /// The payload (`payload`), published exactly as stored: text, json and jsonb as
    /// Postgres prints them, bytea as its bytes. NULL publishes an empty payload.
    pub payload: Ident,
    /// When the row was written (`created_at`, timestamptz): none, no such field.
    pub timestamp: Option<Ident>,
    /// W3C trace context (`traceparent`): none, or a table without it, no trace.
    pub traceparent: Option<Ident>,
    /// Extra columns, each a field of its own (NULL: the field is left out).
    pub extra: Vec<ExtraField>,
    /// The order a catch-up from the table publishes rows in: an integer column that grows
    /// with every insert (an identity), so rows of one key come in the order they were
    /// written when writes of a key are serialised (as an aggregate's are).
    pub order: Ident,
    /// The writing transaction (`xid8 DEFAULT pg_current_xact_id()`), which tells a
    /// catch-up which rows a stream may lack.
    pub tx: Ident,
    /// The column whose value picks the row's stream, when the stream name is a template
    /// (`${routedByValue}`); not published unless also an extra field.
    pub route: Option<Ident>,
    /// Whether `order` and `tx` are read (a catch-up from the table), or the slot is the only
    /// source.
    pub recovery: Recovery,
}

/// Field names of the stream contract, which no alias may take.
pub const RESERVED_FIELDS: [&str; 7] = [
    outbox_core::stream::entry::EVENT,
    outbox_core::stream::entry::PAYLOAD,
    outbox_core::stream::entry::OUTBOX_ID,
    outbox_core::stream::entry::CREATED_AT,
    outbox_core::stream::entry::PUBLISHED_AT,
    outbox_core::stream::entry::TRACEPARENT,
    outbox_core::stream::entry::KEY,
];

/// Column names given on the command line, each overriding the preset's.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub id: Option<String>,
    pub key: Option<String>,
    pub event_type: Option<String>,
    pub payload: Option<String>,
    /// `''`: none.
    pub timestamp: Option<String>,
    /// `''`: none.
    pub traceparent: Option<String>,
    /// `column`, `column:alias`, or Debezium's `column:header|envelope[:alias]`, comma-separated.
    pub extra: Option<String>,
    pub order: Option<String>,
    pub tx: Option<String>,
    /// The routing column; only with a routed stream.
    pub route: Option<String>,
    pub recovery: Recovery,
}

impl OutboxMapping {
    /// The chat's own table, unchanged from before mappings existed.
    pub fn chat(table: OutboxTable) -> Self {
        Self {
            table,
            id: Ident::of("id"),
            key: Ident::of("partition_key"),
            event_type: Ident::of("event"),
            payload: Ident::of("payload"),
            timestamp: Some(Ident::of("created_at")),
            traceparent: Some(Ident::of("traceparent")),
            extra: Vec::new(),
            order: Ident::of("id"),
            tx: Ident::of("tx"),
            route: None,
            recovery: Recovery::Table,
        }
    }

    /// Debezium's Outbox Event Router defaults, plus the two columns a catch-up needs
    /// (`seq`, `tx`), which producers never name.
    pub fn debezium(table: OutboxTable) -> Self {
        Self {
            table,
            id: Ident::of("id"),
            key: Ident::of("aggregateid"),
            event_type: Ident::of("type"),
            payload: Ident::of("payload"),
            timestamp: None,
            traceparent: None,
            extra: Vec::new(),
            order: Ident::of("seq"),
            tx: Ident::of("tx"),
            route: None,
            recovery: Recovery::Table,
        }
    }

    /// The preset's mapping with the overrides applied, checked; `routed`: the stream name
    /// is a template, so a route column is needed (Debezium's default: `aggregatetype`).
    pub fn build(
        preset: Preset,
        table: OutboxTable,
        overrides: &Overrides,
        routed: bool,
    ) -> Result<Self, String> {
        let mut mapping = match preset {
            Preset::Chat => Self::chat(table),
            Preset::Debezium => Self::debezium(table),
        };
        let column = |flag: &str, value: &str| {
            Ident::parse(value).ok_or_else(|| {
                format!("{flag} '{value}' is not a column name: use 1-63 lowercase letters, digits and underscores")
            })
        };
        let optional = |flag: &str, value: &str| {
            if value.is_empty() {
                Ok(None)
            } else {
                column(flag, value).map(Some)
            }
        };
        if let Some(v) = &overrides.id {
            mapping.id = column("--outbox-id-column", v)?;
        }
        if let Some(v) = &overrides.key {
            mapping.key = column("--outbox-key-column", v)?;
        }
        if let Some(v) = &overrides.event_type {
            mapping.event_type = column("--outbox-type-column", v)?;
        }
        if let Some(v) = &overrides.payload {
            mapping.payload = column("--outbox-payload-column", v)?;
        }
        if let Some(v) = &overrides.timestamp {
            mapping.timestamp = optional("--outbox-timestamp-column", v)?;
        }
        if let Some(v) = &overrides.traceparent {
            mapping.traceparent = optional("--outbox-traceparent-column", v)?;
        }
        if let Some(v) = &overrides.order {
            mapping.order = column("--outbox-order-column", v)?;
        }
        if let Some(v) = &overrides.tx {
            mapping.tx = column("--outbox-tx-column", v)?;
        }
        if let Some(v) = &overrides.extra {
            mapping.extra = parse_extra(v)?;
        }
        mapping.recovery = overrides.recovery;
        mapping.route = match (&overrides.route, routed, preset) {
            (Some(v), true, _) => Some(column("--outbox-route-column", v)?),
            (None, true, Preset::Debezium) => Some(Ident::of("aggregatetype")),
            (None, true, Preset::Chat) => {
                return Err("--stream names a route (${routedByValue}): say which column holds it with --outbox-route-column".into())
            }
            (Some(v), false, _) => {
                return Err(format!("--outbox-route-column '{v}' needs a routed --stream: put ${{routedByValue}} where the route goes, e.g. outbox.event.${{routedByValue}}"))
            }
            (None, false, _) => None,
        };
        mapping.check()?;
        Ok(mapping)
    }

    /// No column is two of id, key, type, payload and timestamp; no extra field takes a
    /// contract name or another's.
    fn check(&self) -> Result<(), String> {
        let mut roles: Vec<(&str, &Ident)> = vec![
            ("id", &self.id),
            ("key", &self.key),
            ("type", &self.event_type),
            ("payload", &self.payload),
        ];
        if let Some(t) = &self.timestamp {
            roles.push(("timestamp", t));
        }
        for (i, (role, column)) in roles.iter().enumerate() {
            if let Some((other, _)) = roles[..i].iter().find(|(_, c)| c == column) {
                return Err(format!(
                    "column '{column}' is mapped as both the {other} and the {role}: each needs its own column"
                ));
            }
        }
        for (i, extra) in self.extra.iter().enumerate() {
            if RESERVED_FIELDS.contains(&extra.field.as_str()) {
                return Err(format!(
                    "--outbox-fields: '{}' is a field every entry has already; give column '{}' another name (column:alias)",
                    extra.field, extra.column
                ));
            }
            if self.extra[..i].iter().any(|e| e.field == extra.field) {
                return Err(format!(
                    "--outbox-fields names field '{}' twice",
                    extra.field
                ));
            }
        }
        Ok(())
    }

    /// Whether a stream's losses can be brought back from the table.
    pub fn recovers_from_table(&self) -> bool {
        self.recovery == Recovery::Table
    }

    /// Every column the relay reads, with what it is for (for the start-up check).
    pub fn columns(&self) -> Vec<(&'static str, &Ident)> {
        let mut columns = vec![
            ("id", &self.id),
            ("type", &self.event_type),
            ("payload", &self.payload),
        ];
        if self.recovery == Recovery::Table {
            columns.extend([("order", &self.order), ("tx", &self.tx)]);
        }
        if let Some(t) = &self.timestamp {
            columns.push(("timestamp", t));
        }
        if let Some(r) = &self.route {
            columns.push(("route", r));
        }
        for extra in &self.extra {
            columns.push(("extra field", &extra.column));
        }
        columns
    }
}

/// `column`, `column:alias`, `column:header`, `column:envelope:alias`, comma-separated.
fn parse_extra(text: &str) -> Result<Vec<ExtraField>, String> {
    let mut fields = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let parts: Vec<&str> = item.split(':').collect();
        let (column, alias) = match parts.as_slice() {
            [column] => (*column, None),
            [column, "header" | "envelope"] => (*column, None),
            [_, "partition", ..] => {
                return Err(format!(
                    "--outbox-fields '{item}': a Redis stream has no partitions; the key column (--outbox-key-column) picks the shard"
                ))
            }
            [column, alias] => (*column, Some(*alias)),
            [column, "header" | "envelope", alias] => (*column, Some(*alias)),
            _ => {
                return Err(format!(
                    "--outbox-fields '{item}' is not column, column:alias or column:header|envelope:alias"
                ))
            }
        };
        let column = Ident::parse(column)
            .ok_or_else(|| format!("--outbox-fields '{item}': '{column}' is not a column name"))?;
        let field = match alias {
            None => column.as_str().to_string(),
            Some(alias) if valid_field(alias) => alias.to_string(),
            Some(alias) => {
                return Err(format!(
                    "--outbox-fields '{item}': '{alias}' is not a field name (letters, digits, '_', '-', '.')"
                ))
            }
        };
        fields.push(ExtraField { column, field });
    }
    Ok(fields)
}

fn valid_field(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> OutboxTable {
        "public.outbox".parse().unwrap()
    }

    #[test]
    fn presets_name_their_columns_and_overrides_replace_them() {
        let chat =
            OutboxMapping::build(Preset::Chat, table(), &Overrides::default(), false).unwrap();
        assert_eq!(chat, OutboxMapping::chat(table()));
        let dbz = OutboxMapping::build(
            Preset::Debezium,
            table(),
            &Overrides {
                timestamp: Some("occurred_at".into()),
                extra: Some("aggregatetype:header:aggregate_type, tenant".into()),
                ..Overrides::default()
            },
            true,
        )
        .unwrap();
        assert_eq!(dbz.key.as_str(), "aggregateid");
        assert_eq!(dbz.route.as_ref().unwrap().as_str(), "aggregatetype");
        assert_eq!(dbz.event_type.as_str(), "type");
        assert_eq!(dbz.timestamp.unwrap().as_str(), "occurred_at");
        assert_eq!(
            dbz.extra
                .iter()
                .map(|e| (e.column.as_str(), e.field.as_str()))
                .collect::<Vec<_>>(),
            [("aggregatetype", "aggregate_type"), ("tenant", "tenant")]
        );
        let none = OutboxMapping::build(
            Preset::Chat,
            table(),
            &Overrides {
                timestamp: Some(String::new()),
                traceparent: Some(String::new()),
                ..Overrides::default()
            },
            false,
        )
        .unwrap();
        assert_eq!((none.timestamp, none.traceparent), (None, None));
        assert_eq!(none.route, None);
    }

    #[test]
    fn bad_mappings_are_refused_saying_why() {
        let err =
            |o: Overrides| OutboxMapping::build(Preset::Debezium, table(), &o, false).unwrap_err();
        assert!(err(Overrides {
            key: Some("Aggregate".into()),
            ..Overrides::default()
        })
        .contains("--outbox-key-column 'Aggregate' is not a column name"));
        assert!(err(Overrides {
            key: Some("type".into()),
            ..Overrides::default()
        })
        .contains("mapped as both the key and the type"));
        assert!(err(Overrides {
            extra: Some("aggregatetype:event".into()),
            ..Overrides::default()
        })
        .contains("'event' is a field every entry has already"));
        assert!(err(Overrides {
            extra: Some("a:x,b:x".into()),
            ..Overrides::default()
        })
        .contains("names field 'x' twice"));
        assert!(err(Overrides {
            extra: Some("a:partition".into()),
            ..Overrides::default()
        })
        .contains("no partitions"));
        assert!(err(Overrides {
            extra: Some("a:b:c:d".into()),
            ..Overrides::default()
        })
        .contains("is not column"));
        assert!(err(Overrides {
            route: Some("aggregatetype".into()),
            ..Overrides::default()
        })
        .contains("needs a routed --stream"));
        let chat = OutboxMapping::build(Preset::Chat, table(), &Overrides::default(), true);
        assert!(chat.unwrap_err().contains("--outbox-route-column"));
    }
}
