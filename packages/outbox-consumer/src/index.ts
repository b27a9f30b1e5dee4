// outbox-stream-consumer: the receiving end of a cdc-relay outbox stream (stream contract v1,
// docs/contract/v1.md) for Node services.
export { Consumer, type ConsumerOptions } from "./consumer.js";
export { RecordError, type Decoded, type Fence, type Inbox, type RecordErrorKind } from "./inbox.js";
export { PgFence, classifyPgError } from "./pg.js";
export {
  assign,
  compareEntryIds,
  decodeEntry,
  fnv1a64,
  keys,
  parseEntryId,
  shardKey,
  shardOf,
  textField,
  type Entry,
  type EntryFields,
  type EntryId,
} from "./contract.js";
