"""Folders other tools wrote read as the rows they hold (issue 71): Spark / Hive output (``_SUCCESS``,
``_committed_*``, ``_started_*``, ``.crc`` files, ``part-*.snappy.parquet``, ``key=value/`` partitions), Ray Data's
``write_parquet`` / ``write_json``, and a pyarrow dataset with ``_metadata`` / ``_common_metadata``; on disk and on
the suite's S3 endpoint. Before the fix, ``_SUCCESS`` sorted first and chose the format (Parquet parsed as JSON
lines), and ``data.format=parquet`` failed on a 0-byte "Parquet file"."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipelines.readers import corpus_files, load_corpus

PAIRS = [{"text1": f"premise {i}", "text2": f"hypothesis {i}", "label": i % 3} for i in range(30)]


def _sorted(rows):
    return sorted((r["text1"], r["text2"], r["label"]) for r in rows)


def _spark_parquet(folder):
    """Spark's layout of ``df.write.parquet``: two part files, their checksums, the commit markers."""
    folder.mkdir(parents=True)
    for n, part in enumerate((PAIRS[:17], PAIRS[17:])):
        name = f"part-0000{n}-5c1d7e1a-0e8b-4f3a-9d59-1b0c4b2e7f1a-c000.snappy.parquet"
        pq.write_table(pa.Table.from_pylist(part), folder / name, compression="snappy")
        (folder / f".{name}.crc").write_bytes(b"crc\x00\x01")
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / "._SUCCESS.crc").write_bytes(b"crc")
    (folder / "_committed_8231201931").write_text('{"added":["part-00000"],"removed":[]}')
    (folder / "_started_8231201931").write_bytes(b"")
    return folder


def _hive_partitioned(folder):
    """``df.write.partitionBy("label").json(...)``: the label is a folder name, not a field of the files."""
    for label in range(3):
        part = folder / f"label={label}"
        part.mkdir(parents=True)
        rows = [{k: v for k, v in r.items() if k != "label"} for r in PAIRS if r["label"] == label]
        (part / "part-00000-aa.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (part / ".part-00000-aa.json.crc").write_bytes(b"crc")
    (folder / "_SUCCESS").write_bytes(b"")
    return folder


def _pyarrow_dataset(folder):
    """pyarrow's dataset with the summary files Dask and Spark read: ``_metadata`` and ``_common_metadata``."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(PAIRS)
    collector = []
    for n in range(3):
        pq.write_table(table.slice(10 * n, 10), folder / f"chunk-{n}.parquet", row_group_size=5,
                       metadata_collector=collector)
        collector[-1].set_file_path(f"chunk-{n}.parquet")
    pq.write_metadata(table.schema, folder / "_common_metadata")
    pq.write_metadata(table.schema, folder / "_metadata", metadata_collector=collector)
    return folder


def _ray_data(folder, writer):
    import ray

    ds = ray.data.from_items(PAIRS, override_num_blocks=3)
    getattr(ds, writer)(str(folder))
    return folder


@pytest.mark.parametrize("layout", ["spark_parquet", "hive_partitioned_json", "pyarrow_dataset", "ray_write_parquet",
                                    "ray_write_json"])
def test_a_folder_another_tool_wrote_reads_as_its_rows_on_disk_and_on_s3(ray_local, tmp_path, s3, layout):
    folder = tmp_path / layout
    made = {"spark_parquet": lambda: _spark_parquet(folder), "hive_partitioned_json": lambda: _hive_partitioned(folder),
            "pyarrow_dataset": lambda: _pyarrow_dataset(folder),
            "ray_write_parquet": lambda: _ray_data(folder, "write_parquet"),
            "ray_write_json": lambda: _ray_data(folder, "write_json")}[layout]()
    for source in (made, s3.upload(made, layout)):
        ds, report = load_corpus("pairs", source)
        assert _sorted(ds.take_all()) == _sorted(PAIRS), source
        assert report.rows_in == len(PAIRS) and report.rows_quarantined == 0
        assert not any(name.rsplit("/", 1)[-1][:1] in "._" for name in report.files)


def test_the_format_comes_from_the_data_files_and_an_explicit_parquet_skips_the_empty_marker(ray_local, tmp_path):
    """``_SUCCESS`` sorts before ``part-*`` and once chose the format (JSON lines for a Parquet folder); with
    ``data.format=parquet`` the driver read it as a 0-byte Parquet file."""
    folder = _spark_parquet(tmp_path / "spark")
    files, fmt = corpus_files(folder, "pairs", "auto")
    assert fmt == "parquet" and [f.name.split("-")[0] for f in files] == ["part", "part"]
    ds, _ = load_corpus("pairs", folder, fmt="parquet")
    assert ds.count() == len(PAIRS)


def test_a_stray_file_does_not_choose_the_format_and_a_folder_of_mixed_formats_is_refused(ray_local, tmp_path):
    folder = _spark_parquet(tmp_path / "spark")
    (folder / "README").write_text("written by the nightly export\n")  # no data suffix: not read
    assert corpus_files(folder, "pairs", "auto")[1] == "parquet"
    (folder / "extra.jsonl").write_text(json.dumps(PAIRS[0]) + "\n")
    with pytest.raises(ValueError, match=r"extra\.jsonl.* cannot read part-"):
        corpus_files(folder, "pairs", "auto")


def test_partition_values_fill_only_what_a_record_lacks_and_refuse_formats_without_records(ray_local, tmp_path):
    folder = tmp_path / "partitioned"
    (folder / "label=contradiction").mkdir(parents=True)
    (folder / "label=contradiction" / "a.jsonl").write_text(
        json.dumps({"text1": "a", "text2": "b"}) + "\n" + json.dumps({"text1": "c", "text2": "d", "label": 0}) + "\n")
    ds, _ = load_corpus("pairs", folder)
    assert sorted((r["text1"], r["label"]) for r in ds.take_all()) == [("a", 2), ("c", 0)]
    csv_folder = tmp_path / "csv" / "genre=news"
    csv_folder.mkdir(parents=True)
    (csv_folder / "a.csv").write_text("text1,text2,label\nx,y,0\n")
    with pytest.raises(Exception, match="key=value folders"):
        load_corpus("pairs", tmp_path / "csv")
