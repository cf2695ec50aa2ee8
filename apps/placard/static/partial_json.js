// Parse a prefix of a JSON document (a response still streaming in) into what is known so far.
//
// parsePartialJson('{"title": "Egyptian C') -> {value: {title: "Egyptian C"}, complete: false,
// openPath: ["title"]}. Strings are shown as far as they have arrived (a half-received escape is
// held back); numbers and true/false/null only once they are whole, since "1" may become "12"; a
// key whose value has not started is left out. Text that can never become JSON throws SyntaxError.
//
// Each call re-reads the whole prefix: a placard is a few hundred characters, so this is cheaper
// than keeping resumable parser state across chunks, and it cannot drift from the text.

const NOT_YET = Symbol("not yet known");

class PrefixParser {
  constructor(text) {
    this.text = text;
    this.pos = 0;
    this.truncated = false; // the text ended inside a value
    this.openPath = null; // where the text ended, when it ended inside a string value
  }

  eof() {
    return this.pos >= this.text.length;
  }

  skipSpace() {
    while (!this.eof() && " \t\r\n".includes(this.text[this.pos])) this.pos++;
  }

  fail(what) {
    throw new SyntaxError(`expected ${what} at offset ${this.pos} of the JSON text`);
  }

  value(path) {
    this.skipSpace();
    if (this.eof()) {
      this.truncated = true;
      return NOT_YET;
    }
    const c = this.text[this.pos];
    if (c === "{") return this.object(path);
    if (c === "[") return this.array(path);
    if (c === '"') return this.string(path);
    if (c === "-" || (c >= "0" && c <= "9")) return this.number();
    return this.literal();
  }

  object(path) {
    const out = {};
    this.pos++; // {
    for (let first = true; ; first = false) {
      this.skipSpace();
      if (this.eof()) return this.cut(out);
      if (this.text[this.pos] === "}") {
        this.pos++;
        return out;
      }
      if (!first) {
        if (this.text[this.pos] !== ",") this.fail("',' or '}'");
        this.pos++;
        this.skipSpace();
        if (this.eof()) return this.cut(out);
      }
      if (this.text[this.pos] !== '"') this.fail("a key");
      const key = this.string(null);
      if (this.truncated) return out; // half a key names nothing yet
      this.skipSpace();
      if (this.eof()) return this.cut(out);
      if (this.text[this.pos] !== ":") this.fail("':'");
      this.pos++;
      const item = this.value([...path, key]);
      if (item !== NOT_YET) out[key] = item;
      if (this.truncated) return out;
    }
  }

  array(path) {
    const out = [];
    this.pos++; // [
    for (let first = true; ; first = false) {
      this.skipSpace();
      if (this.eof()) return this.cut(out);
      if (this.text[this.pos] === "]") {
        this.pos++;
        return out;
      }
      if (!first) {
        if (this.text[this.pos] !== ",") this.fail("',' or ']'");
        this.pos++;
      }
      const item = this.value([...path, out.length]);
      if (item !== NOT_YET) out.push(item);
      if (this.truncated) return out;
    }
  }

  string(path) {
    this.pos++; // opening quote
    let out = "";
    while (!this.eof()) {
      const c = this.text[this.pos];
      if (c === '"') {
        this.pos++;
        return out;
      }
      if (c !== "\\") {
        out += c;
        this.pos++;
        continue;
      }
      const escape = this.readEscape();
      if (escape === NOT_YET) break; // a half-received escape: shown once it is whole
      out += escape;
    }
    this.truncated = true;
    if (path !== null) this.openPath = path;
    return out;
  }

  readEscape() {
    const code = this.text[this.pos + 1];
    if (code === undefined) return NOT_YET;
    const simple = { '"': '"', "\\": "\\", "/": "/", b: "\b", f: "\f", n: "\n", r: "\r", t: "\t" };
    if (code in simple) {
      this.pos += 2;
      return simple[code];
    }
    if (code !== "u") this.fail("a string escape");
    const hex = this.text.slice(this.pos + 2, this.pos + 6);
    if (!/^[0-9a-fA-F]*$/.test(hex)) this.fail("four hex digits");
    if (hex.length < 4) return NOT_YET;
    this.pos += 6;
    return String.fromCharCode(parseInt(hex, 16));
  }

  number() {
    const match = /^-?(0|[1-9]\d*)?(\.\d*)?([eE][+-]?\d*)?/.exec(this.text.slice(this.pos));
    this.pos += match[0].length;
    if (this.eof()) {
      this.truncated = true; // more digits may follow
      return NOT_YET;
    }
    const value = Number(match[0]);
    if (match[0] === "" || Number.isNaN(value)) this.fail("a number");
    return value;
  }

  literal() {
    for (const [word, value] of [["true", true], ["false", false], ["null", null]]) {
      const rest = this.text.slice(this.pos, this.pos + word.length);
      if (rest === word) {
        this.pos += word.length;
        return value;
      }
      if (word.startsWith(rest) && this.pos + rest.length === this.text.length) {
        this.pos = this.text.length;
        this.truncated = true;
        return NOT_YET;
      }
    }
    return this.fail("a JSON value");
  }

  cut(partial) {
    this.truncated = true;
    return partial;
  }
}

export function parsePartialJson(text) {
  const parser = new PrefixParser(text);
  const value = parser.value([]);
  if (!parser.truncated) {
    parser.skipSpace();
    if (!parser.eof()) parser.fail("the end of the JSON text");
  }
  return {
    value: value === NOT_YET ? undefined : value,
    complete: !parser.truncated,
    openPath: parser.openPath ?? [],
  };
}
