/*
 * batchline's records read and written by a client batchline did not write: Apache Avro's Java reference
 * implementation (BinaryMessageDecoder / BinaryMessageEncoder, SchemaStore), here Debian's libavro-java 1.8.2.
 *
 * A downstream consumer in another language reads a job's results (J.results), dead letters (J.dlq), run
 * manifests and ledger snapshots, and the `batchline-lineage` header of every result, by the single-object
 * header alone: C3 01 + the schema's CRC-64-AVRO fingerprint (8 little-endian bytes) + the body. The decoder
 * finds the writer's schema by that fingerprint in a SchemaStore holding schemas/*.avsc and the versions before
 * them (schemas/previous/KIND.vN.avsc), and resolves it to the reader's schema (today's): records written before
 * a field was added read with the field's default, and a consumer built on an older schema keeps reading what
 * newer workers write.
 * An upstream Java service publishes Requests to J.requests the same way; the worker reads them.
 *
 * Guarantees: every record batchline writes decodes here, with the field values batchline wrote, and so does
 * every record written with a previous version of its schema; every Request this program encodes is read by
 * batchline's worker. Records written by batchline 0.1.0 (fingerprint
 * bytes reversed) fail here with MissingSchemaException, as in any spec-following decoder.
 *
 * In a Kafka consumer (org.apache.kafka:kafka-clients), per record:
 *   GenericRecord result = decoders.get("result").decode(record.value());
 *   GenericRecord lineage = decoders.get("lineage").decode(record.headers().lastHeader("batchline-lineage").value());
 *
 * Command line (bytes as base64, one record per line, so it can be fed from any tool):
 *   java -cp CLASSPATH BatchlineAvro decode SCHEMAS_DIR < lines of "KIND BASE64"
 *       prints one JSON object per line: {"kind", "header" (hex), "record", "reencoded" (base64)}
 *       or {"kind", "error"} for a record the reference decoder rejects.
 *   java -cp CLASSPATH BatchlineAvro requests SCHEMAS_DIR < lines of "ID<TAB>PROMPT"
 *       prints one base64 single-object Request per line, ready to publish to J.requests with the id as key.
 */

import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.OutputStreamWriter;
import java.io.PrintWriter;
import java.io.StringWriter;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.Base64;
import java.util.Collection;
import java.util.LinkedHashMap;
import java.util.Map;

import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.generic.GenericRecordBuilder;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.BinaryMessageEncoder;
import org.apache.avro.message.SchemaStore;
import org.codehaus.jackson.JsonFactory;
import org.codehaus.jackson.JsonGenerator;

public final class BatchlineAvro {
    static final String[] KINDS = {"request", "result", "dead_letter", "lineage", "run_manifest", "run_stats"};

    private final Map<String, Schema> schemas = new LinkedHashMap<>();
    private final Map<String, BinaryMessageDecoder<GenericRecord>> decoders = new LinkedHashMap<>();
    private final JsonFactory json = new JsonFactory();

    BatchlineAvro(Path schemaDir) throws IOException {
        SchemaStore.Cache store = new SchemaStore.Cache();
        for (String kind : KINDS) {
            Schema schema = new Schema.Parser().parse(schemaDir.resolve(kind + ".avsc").toFile());
            schemas.put(kind, schema);
            store.addSchema(schema);
        }
        // Earlier versions: writers' schemas only, found by fingerprint; one parser each (they share names).
        Path previous = schemaDir.resolve("previous");
        if (Files.isDirectory(previous)) {
            try (DirectoryStream<Path> files = Files.newDirectoryStream(previous, "*.avsc")) {
                for (Path file : files) {
                    store.addSchema(new Schema.Parser().parse(file.toFile()));
                }
            }
        }
        for (String kind : KINDS) {
            // The reader's schema is this kind's; the writer's is looked up by the header's fingerprint.
            decoders.put(kind, new BinaryMessageDecoder<GenericRecord>(GenericData.get(), schemas.get(kind), store));
        }
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 2 || !(args[0].equals("decode") || args[0].equals("requests"))) {
            System.err.println("usage: BatchlineAvro decode|requests SCHEMAS_DIR < lines");
            System.exit(2);
        }
        BatchlineAvro avro = new BatchlineAvro(Paths.get(args[1]));
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        PrintWriter out = new PrintWriter(new OutputStreamWriter(System.out, StandardCharsets.UTF_8));
        for (String line = in.readLine(); line != null; line = in.readLine()) {
            if (line.isEmpty()) {
                continue;
            }
            out.println(args[0].equals("decode") ? avro.decodeLine(line) : avro.encodeRequest(line));
        }
        out.flush();
    }

    /** "KIND BASE64" -> one JSON line describing what the reference decoder read. */
    String decodeLine(String line) throws IOException {
        String[] parts = line.split(" ", 2);
        String kind = parts[0];
        byte[] bytes = Base64.getDecoder().decode(parts[1].trim());
        StringWriter text = new StringWriter();
        JsonGenerator gen = json.createJsonGenerator(text);
        gen.writeStartObject();
        gen.writeStringField("kind", kind);
        try {
            GenericRecord record = decoders.get(kind).decode(bytes);
            gen.writeStringField("header", hex(bytes, 10));
            gen.writeFieldName("record");
            writeValue(gen, record);
            ByteBuffer again = new BinaryMessageEncoder<GenericRecord>(GenericData.get(), schemas.get(kind)).encode(record);
            gen.writeStringField("reencoded", Base64.getEncoder().encodeToString(toBytes(again)));
        } catch (Exception e) {  // MissingSchemaException, BadHeaderException, AvroRuntimeException, ...
            gen.writeStringField("error", e.getClass().getSimpleName() + ": " + e.getMessage());
        }
        gen.writeEndObject();
        gen.close();
        return text.toString();
    }

    /** "ID<TAB>PROMPT" -> base64 of a single-object Request (open stream: no run id). */
    String encodeRequest(String line) throws IOException {
        String[] parts = line.split("\t", 2);
        Map<String, String> metadata = new LinkedHashMap<>();
        metadata.put("producer", "java");
        GenericRecord request = new GenericRecordBuilder(schemas.get("request"))
                .set("id", parts[0])
                .set("prompt", parts[1])
                .set("metadata", metadata)
                .build();  // every other field takes its schema default
        ByteBuffer bytes = new BinaryMessageEncoder<GenericRecord>(GenericData.get(), schemas.get("request")).encode(request);
        return Base64.getEncoder().encodeToString(toBytes(bytes));
    }

    /** Generic data as plain JSON: unions unwrapped, bytes as base64, floats widened to doubles exactly. */
    static void writeValue(JsonGenerator gen, Object value) throws IOException {
        if (value == null) {
            gen.writeNull();
        } else if (value instanceof GenericRecord) {
            GenericRecord record = (GenericRecord) value;
            gen.writeStartObject();
            for (Schema.Field field : record.getSchema().getFields()) {
                gen.writeFieldName(field.name());
                writeValue(gen, record.get(field.pos()));
            }
            gen.writeEndObject();
        } else if (value instanceof Map) {
            gen.writeStartObject();
            for (Map.Entry<?, ?> entry : ((Map<?, ?>) value).entrySet()) {
                gen.writeFieldName(entry.getKey().toString());
                writeValue(gen, entry.getValue());
            }
            gen.writeEndObject();
        } else if (value instanceof Collection) {
            gen.writeStartArray();
            for (Object item : (Collection<?>) value) {
                writeValue(gen, item);
            }
            gen.writeEndArray();
        } else if (value instanceof ByteBuffer) {
            gen.writeBinary(toBytes((ByteBuffer) value));
        } else if (value instanceof Float) {
            gen.writeNumber((double) (Float) value);
        } else if (value instanceof Double) {
            gen.writeNumber((Double) value);
        } else if (value instanceof Integer) {
            gen.writeNumber((Integer) value);
        } else if (value instanceof Long) {
            gen.writeNumber((Long) value);
        } else if (value instanceof Boolean) {
            gen.writeBoolean((Boolean) value);
        } else {
            gen.writeString(value.toString());  // Utf8, String, enum symbols
        }
    }

    static byte[] toBytes(ByteBuffer buffer) {
        ByteBuffer copy = buffer.duplicate();
        byte[] bytes = new byte[copy.remaining()];
        copy.get(bytes);
        return bytes;
    }

    static String hex(byte[] bytes, int n) {
        StringBuilder sb = new StringBuilder();
        for (int i = 0; i < Math.min(n, bytes.length); i++) {
            sb.append(String.format("%02x", bytes[i] & 0xff));
        }
        return sb.toString();
    }
}
