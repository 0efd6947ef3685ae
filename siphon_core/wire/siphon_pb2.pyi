from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Operation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_UNSPECIFIED: _ClassVar[Operation]
    INSERT: _ClassVar[Operation]
    UPDATE: _ClassVar[Operation]
    DELETE: _ClassVar[Operation]
    TRUNCATE: _ClassVar[Operation]
    SNAPSHOT: _ClassVar[Operation]

class ValueEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_ENCODING_UNSPECIFIED: _ClassVar[ValueEncoding]
    PGOUTPUT_TUPLE: _ClassVar[ValueEncoding]
OPERATION_UNSPECIFIED: Operation
INSERT: Operation
UPDATE: Operation
DELETE: Operation
TRUNCATE: Operation
SNAPSHOT: Operation
VALUE_ENCODING_UNSPECIFIED: ValueEncoding
PGOUTPUT_TUPLE: ValueEncoding

class Column(_message.Message):
    __slots__ = ("name", "type_oid", "type_name", "primary_key", "type_modifier", "nullable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_OID_FIELD_NUMBER: _ClassVar[int]
    TYPE_NAME_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_KEY_FIELD_NUMBER: _ClassVar[int]
    TYPE_MODIFIER_FIELD_NUMBER: _ClassVar[int]
    NULLABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    type_oid: int
    type_name: str
    primary_key: bool
    type_modifier: int
    nullable: bool
    def __init__(self, name: _Optional[str] = ..., type_oid: _Optional[int] = ..., type_name: _Optional[str] = ..., primary_key: _Optional[bool] = ..., type_modifier: _Optional[int] = ..., nullable: _Optional[bool] = ...) -> None: ...

class Row(_message.Message):
    __slots__ = ("tuple",)
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    tuple: bytes
    def __init__(self, tuple: _Optional[bytes] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("operation", "xid", "commit_lsn", "position", "commit_time_us", "new_row", "old_row", "old_row_is_full", "old_row_is_key")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_LSN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TIME_US_FIELD_NUMBER: _ClassVar[int]
    NEW_ROW_FIELD_NUMBER: _ClassVar[int]
    OLD_ROW_FIELD_NUMBER: _ClassVar[int]
    OLD_ROW_IS_FULL_FIELD_NUMBER: _ClassVar[int]
    OLD_ROW_IS_KEY_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    xid: int
    commit_lsn: int
    position: int
    commit_time_us: int
    new_row: Row
    old_row: Row
    old_row_is_full: bool
    old_row_is_key: bool
    def __init__(self, operation: _Optional[_Union[Operation, str]] = ..., xid: _Optional[int] = ..., commit_lsn: _Optional[int] = ..., position: _Optional[int] = ..., commit_time_us: _Optional[int] = ..., new_row: _Optional[_Union[Row, _Mapping]] = ..., old_row: _Optional[_Union[Row, _Mapping]] = ..., old_row_is_full: _Optional[bool] = ..., old_row_is_key: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "count")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class Package(_message.Message):
    __slots__ = ("application_identifier", "schema", "table", "relation_id", "columns", "events", "value_encoding", "first_commit_lsn", "first_position", "last_commit_lsn", "last_position", "chunk", "producer_version", "event_chunk", "sequence")
    APPLICATION_IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    RELATION_ID_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    VALUE_ENCODING_FIELD_NUMBER: _ClassVar[int]
    FIRST_COMMIT_LSN_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMIT_LSN_FIELD_NUMBER: _ClassVar[int]
    LAST_POSITION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    application_identifier: str
    schema: str
    table: str
    relation_id: int
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    value_encoding: ValueEncoding
    first_commit_lsn: int
    first_position: int
    last_commit_lsn: int
    last_position: int
    chunk: Chunk
    producer_version: str
    event_chunk: bytes
    sequence: int
    def __init__(self, application_identifier: _Optional[str] = ..., schema: _Optional[str] = ..., table: _Optional[str] = ..., relation_id: _Optional[int] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., value_encoding: _Optional[_Union[ValueEncoding, str]] = ..., first_commit_lsn: _Optional[int] = ..., first_position: _Optional[int] = ..., last_commit_lsn: _Optional[int] = ..., last_position: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., producer_version: _Optional[str] = ..., event_chunk: _Optional[bytes] = ..., sequence: _Optional[int] = ...) -> None: ...
