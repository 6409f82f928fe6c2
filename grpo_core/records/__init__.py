"""The files the project writes and later reads back, each with one typed schema, read in one bounded way.

A checkpoint's trainer state and manifest, a PEFT adapter (its config and tensors), the rows a model has seen, an
evaluation set, a prepare record, a registry version's tags: by the time they are read again, whoever can write
where they lie may have changed them, and a checksum the same person can rebuild proves nothing. So the content
itself is checked: ``reader.read_json`` refuses a file larger than its record can be before parsing it, parses
it with pydantic (nesting bounded) and checks it against the record's model in strict mode (a string is never
read as a number, nor as the list of its characters). Whatever is wrong is one RecordError naming the file and
the field, which the CLI prints as one line, exit 2.

One module per kind of file: checkpoint.py, adapter.py, data.py, tags.py; reader.py holds what they share. The
package imports nothing of grpo_core but config (the choices a record's fields take), so every layer can use it.
"""
